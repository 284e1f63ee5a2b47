"""Names and ownership: fdcore- prefix, unguessable ids, sweep of dead owners."""

from __future__ import annotations

import os

import pytest

from fdcore.actors import topology
from fdcore.ipc import Inbox, Ring, names

pytestmark = pytest.mark.tree


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
    instance = names.new_instance_id()
    names.claim_instance(instance)
    ring = Ring.create(4096, name=names.object_name(instance, "orphan"))
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
        assert orphan[1:].replace("-orphan", "-owner") in removed
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


def _instance_with_record(pid: int, start, namespace) -> str:
    """An instance owned (says its record) by pid, started at ``start``, in pid namespace ``namespace``."""
    instance = names.new_instance_id(pid)
    path = os.path.join(names.SHM_DIR, names.object_name(instance, names.OWNER_LINK).lstrip("/"))
    with open(path, "w") as f:
        f.write(f"{pid} {start} {namespace}\n")
    Ring.create(4096, name=names.object_name(instance, "left")).close()
    return instance


def _left(instance: str) -> list[str]:
    return [e.filename for e in names.list_entries() if e.instance_id == instance]


def test_sweep_removes_only_instances_whose_owner_is_verifiably_gone():
    me, start, namespace = os.getpid(), names.process_start_time(os.getpid()), names.pid_namespace()
    alive = _instance_with_record(me, start, namespace)
    reused = _instance_with_record(me, start - 1, namespace)  # our pid, but not the process that made it
    elsewhere = _instance_with_record(me, start - 1, namespace + 1)  # another pid namespace: unknowable
    unrecorded = names.new_instance_id(2**22 + 1)  # no owner record (and no such pid): proves nothing
    Ring.create(4096, name=names.object_name(unrecorded, "left")).close()
    try:
        removed = names.sweep()
        assert not _left(reused) and len([f for f in removed if reused in f]) == 4  # ring, 2 semaphores, record
        assert len(_left(alive)) == 4 and len(_left(elsewhere)) == 4 and len(_left(unrecorded)) == 3
    finally:
        for instance in (alive, reused, elsewhere, unrecorded):
            names.unlink_instance(instance)


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's entry needs root")
def test_sweep_leaves_another_users_entries_alone():
    instance = _instance_with_record(os.getpid(), 1, names.pid_namespace())  # owner verifiably gone
    try:
        for filename in _left(instance):
            os.chown(os.path.join(names.SHM_DIR, filename), 65534, 65534)
        assert names.sweep() == []
        assert len(_left(instance)) == 4
    finally:
        names.unlink_instance(instance)


def test_an_instance_is_claimed_only_for_a_running_owner():
    with pytest.raises(ValueError, match="not a running process"):
        names.claim_instance(names.new_instance_id(2**22 + 5))


def test_topology_finds_an_instance_by_its_engine_inbox_and_a_client_slot_by_its_file():
    """What a connecting client relies on: the engine inbox (segment and semaphore, not its links,
    nor another child's inbox) marks an instance, and a slot's lock file is its inbox's segment."""
    instance = names.new_instance_id()
    engine, slot = topology.inbox_name(instance, "engine"), topology.inbox_name(instance, topology.client_id(3))
    with Inbox.create(engine, [topology.client_id(3)], capacity=4096), Inbox.create(slot, ["engine"], capacity=4096):
        found = {e.filename for e in names.list_entries() if e.instance_id == instance and topology.is_engine_inbox(e)}
        assert found == {engine[1:], f"sem.{engine[1:]}"}
        assert topology.client_slot_path(instance, 3) == os.path.join(names.SHM_DIR, slot[1:])
        assert os.path.exists(topology.client_slot_path(instance, 3))
