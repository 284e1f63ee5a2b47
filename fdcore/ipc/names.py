"""Names and ownership of fdcore's POSIX shared-memory segments and semaphores.

Every object is named ``fdcore-<instance id>-<link>`` where the instance id is
``<12 random hex digits>.<owner pid>``: the random part makes names unguessable
(no other user can pre-create or squat on them). An instance's owner records
itself in ``fdcore-<instance id>-owner`` (:func:`claim_instance`: pid, the
process's start time and its pid namespace), so that :func:`sweep` removes an
instance only when its owner is verifiably gone: not for a pid that was reused,
nor for one that lives in another pid namespace sharing /dev/shm. Objects are
created with ``O_CREAT|O_EXCL`` and mode 0600; exactly one owner (the process
that created the instance) unlinks them, everyone else only closes.

On Linux, segments appear in ``/dev/shm/<name>`` and semaphores in
``/dev/shm/sem.<name>``.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass

import posix_ipc

from fdcore import envs

PREFIX = "fdcore-"
SHM_DIR = "/dev/shm"
_INSTANCE_RE = re.compile(r"^(?:sem\.)?fdcore-([0-9a-f]{12})\.(\d+)-")
_LINK_RE = re.compile(r"^[A-Za-z0-9_.]+$")
# Up to 4 hex digits that begin every instance id made by this process and its children (a test
# session sets it, so its guard judges only what its own tests made: other fdcore users of the
# machine, another test session among them, are left alone).
TAG_ENV = envs.INSTANCE_TAG
_TAG_RE = re.compile(r"^[0-9a-f]{0,4}$")
OWNER_LINK = "owner"  # the object that records who owns an instance (see claim_instance)


def new_instance_id(pid: int | None = None) -> str:
    """A fresh, unguessable instance id owned by ``pid`` (default: this process)."""
    tag = instance_tag()
    return f"{tag}{secrets.token_hex(6)[len(tag) :]}.{os.getpid() if pid is None else pid}"


def instance_tag() -> str:
    tag = envs.get(TAG_ENV)
    if not _TAG_RE.match(tag):
        raise ValueError(f"{TAG_ENV}={tag!r}: at most 4 lowercase hex digits")
    return tag


def object_name(instance_id: str, link: str) -> str:
    """The POSIX name (leading slash) of one object of an instance."""
    if not _LINK_RE.match(link):
        raise ValueError(f"link name {link!r} may only hold letters, digits, '_' and '.'")
    return f"/{PREFIX}{instance_id}-{link}"


@dataclass(frozen=True)
class ShmEntry:
    """One fdcore object found in /dev/shm."""

    filename: str
    instance_id: str
    owner_pid: int

    @property
    def is_semaphore(self) -> bool:
        return self.filename.startswith("sem.")

    @property
    def posix_name(self) -> str:
        return "/" + self.filename.removeprefix("sem.")


def list_entries(shm_dir: str = SHM_DIR) -> list[ShmEntry]:
    """Every fdcore object currently in ``shm_dir``."""
    entries = []
    for filename in sorted(os.listdir(shm_dir)):
        match = _INSTANCE_RE.match(filename)
        if match:
            token, pid = match.groups()
            entries.append(ShmEntry(filename, f"{token}.{pid}", int(pid)))
    return entries


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def unlink_entry(entry: ShmEntry) -> bool:
    """Unlink one object; False when it was already gone or is not ours to remove."""
    unlink = posix_ipc.unlink_semaphore if entry.is_semaphore else posix_ipc.unlink_shared_memory
    try:
        unlink(entry.posix_name)
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError, PermissionError):
        return False
    return True


def unlink_instance(instance_id: str, shm_dir: str = SHM_DIR) -> int:
    """Unlink every object of one instance; returns how many were removed."""
    return sum(unlink_entry(e) for e in list_entries(shm_dir) if e.instance_id == instance_id)


def claim_instance(instance_id: str, shm_dir: str = SHM_DIR) -> str:
    """Record the owner of an instance (the pid in its id, that process's start time, our pid
    namespace) beside its objects; :func:`sweep` trusts nothing else. Returns the record's path."""
    pid = int(instance_id.rsplit(".", 1)[1])
    start = process_start_time(pid)
    if start is None:
        raise ValueError(f"instance {instance_id}: its owner {pid} is not a running process")
    path = os.path.join(shm_dir, object_name(instance_id, OWNER_LINK).lstrip("/"))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{pid} {start} {pid_namespace()}\n")
    return path


def owner_gone(instance_id: str, shm_dir: str = SHM_DIR) -> bool:
    """True only when the instance's owner record says who owned it and that process is gone: a
    missing or unreadable record, or one from another pid namespace, proves nothing."""
    path = os.path.join(shm_dir, object_name(instance_id, OWNER_LINK).lstrip("/"))
    try:
        with open(path) as f:
            pid, start, namespace = (int(word) for word in f.read().split())
    except (OSError, ValueError):
        return False
    if namespace != pid_namespace():
        return False
    return process_start_time(pid) != start or _is_zombie(pid)


def process_start_time(pid: int) -> int | None:
    """When a process started (clock ticks since boot, /proc/<pid>/stat field 22); None if none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def sweep(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the objects of every instance whose owner is verifiably gone (:func:`owner_gone`)
    and that belong to this user; returns the filenames removed.

    Instances of live owners, of other users, of other pid namespaces and without an owner record
    are left alone, so it is safe to call while other fdcore instances run, whoever runs them.
    The owner record goes last: a sweep cut short can be finished by the next one.
    """
    removed = []
    by_instance: dict[str, list[ShmEntry]] = {}
    for entry in list_entries(shm_dir):
        by_instance.setdefault(entry.instance_id, []).append(entry)
    for instance, entries in by_instance.items():
        if not owner_gone(instance, shm_dir):
            continue
        for entry in sorted(entries, key=lambda e: e.filename.endswith(f"-{OWNER_LINK}")):
            if _ours(entry, shm_dir) and unlink_entry(entry):
                removed.append(entry.filename)
    return removed


def _ours(entry: ShmEntry, shm_dir: str) -> bool:
    try:
        return os.stat(os.path.join(shm_dir, entry.filename)).st_uid == os.getuid()
    except OSError:
        return False
