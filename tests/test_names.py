"""Names and ownership: fdcore- prefix, unguessable ids, sweep of dead owners."""

from __future__ import annotations

import os

import pytest

from fdcore.ipc import Inbox, Ring, names


def test_instance_ids_are_unguessable_and_carry_the_owner_pid():
    ids = {names.new_instance_id() for _ in range(1000)}
    assert len(ids) == 1000
    token, pid = next(iter(ids)).split(".")
    assert len(token) == 12 and int(pid) == os.getpid()


def test_link_names_are_checked():
    assert names.object_name("abc.1", "engine.p0") == "/fdcore-abc.1-engine.p0"
    with pytest.raises(ValueError, match="may only hold"):
        names.object_name("abc.1", "../etc")


def _leave_objects_behind(queue):
    ring = Ring.create(4096, name=names.object_name(names.new_instance_id(), "orphan"))
    queue.put(ring.name)
    os._exit(0)  # dies without unlinking, like a SIGKILLed owner


def test_sweep_removes_dead_owners_objects_and_spares_live_ones(spawn):
    import multiprocessing as mp

    queue = mp.get_context("fork").SimpleQueue()
    spawn(_leave_objects_behind, queue).join(10)
    orphan = queue.get()
    assert os.path.exists("/dev/shm" + orphan)
    with Ring.create(4096) as mine, Inbox.create(names.object_name(names.new_instance_id(), "in")) as box:
        removed = names.sweep()
        assert orphan[1:] in removed and f"sem.{orphan[1:]}" in removed
        assert not os.path.exists("/dev/shm" + orphan)
        assert os.path.exists("/dev/shm" + mine.name)
        assert os.path.exists("/dev/shm" + box.name)


def test_unlink_instance_removes_every_object_of_one_instance():
    instance = names.new_instance_id()
    box = Inbox.create(names.object_name(instance, "engine"), ["a", "b"], capacity=4096)
    box.close()
    assert len([e for e in names.list_entries() if e.instance_id == instance]) == 6
    assert names.unlink_instance(instance) == 6
    assert not [e for e in names.list_entries() if e.instance_id == instance]


def test_this_session_judges_only_its_own_instances(monkeypatch):
    """Instance ids begin with the session's tag (children inherit it), so the leak guard leaves
    another session's or a running server's objects alone."""
    from tests.conftest import SESSION_TAG, _our_entries

    assert names.new_instance_id().startswith(SESSION_TAG)
    other_tag = format((int(SESSION_TAG, 16) + 1) % 0x10000, "04x")
    monkeypatch.setenv(names.TAG_ENV, other_tag)
    with Ring.create(4096) as theirs:
        assert theirs.name.startswith(f"/fdcore-{other_tag}")
        assert theirs.name.lstrip("/") not in _our_entries()
        theirs.unlink()
    monkeypatch.setenv(names.TAG_ENV, "not-hex")
    with pytest.raises(ValueError, match="FDCORE_INSTANCE_TAG"):
        names.new_instance_id()
