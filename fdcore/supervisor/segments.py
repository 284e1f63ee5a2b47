"""Every shared object of a tree: created before any child starts, unlinked when the supervisor ends."""

from __future__ import annotations

import os

from fdcore import envs
from fdcore.actors import topology
from fdcore.actors.health import HealthBoard
from fdcore.config import Config, kv_outlives_workers, model_path
from fdcore.ipc import BroadcastRing, Inbox, Ring, Sender, names
from fdcore.ipc.shm import SHM_DIR, NoSharedMemory, free_bytes
from fdcore.supervisor.children import StartFailure
from fdcore.supervisor.events import log


def shared_memory_line(config: Config, group_bytes: int = 0) -> str:
    """The tree's /dev/shm need as one phrase (logs, --check)."""
    need, objects = topology.shared_memory_need(config, group_bytes)
    return (
        f"{need:,} bytes in {objects} objects (supervisor.ring_capacity = {config.supervisor.ring_capacity:,} "
        f"a link, engine.max_clients = {config.engine.max_clients})"
    )


def nameless_file(directory: str, name: str) -> int:
    """An empty file with no name (``O_TMPFILE``) on ``directory``'s filesystem, else a memfd called ``name``.
    Neither can outlive its last holder, whatever signal ends the tree. A disk filesystem's page cache
    gives a mapped file large folios (Linux 6.x: ext4, xfs), mapped with huge-page TLB entries, where
    shared memory gets 4 KiB pages unless the kernel's shmem THP setting allows more (what that costs:
    DESIGN.md, "Weights that exist once"). The file's pages are written back to the disk once, like any file's."""
    try:
        os.makedirs(directory, exist_ok=True)
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError:  # (no O_TMPFILE on that filesystem, or no directory to be had)
        return os.memfd_create(name, os.MFD_CLOEXEC)


class SharedMemory:
    """The Supervisor's shared objects (a mixin of fdcore.supervisor.tree.Supervisor, whose state these methods
    read and set): the weight and KV files, the inboxes, health board, step ring and a worker group's
    communicator; /dev/shm checked before anything is created, so a start that passes never meets SIGBUS."""

    def _weight_files(self) -> dict[int, int]:
        """One empty shared file per tensor-parallel rank for its packed weights, which the rank's first
        worker fills and its spare, its restarts and the other groups' same rank map (fdcore.models.shared_weights)."""
        workers = self.config.workers
        if self.config.model.backend == "null" or workers.shared_weights == "off":
            return {}
        return {
            rank: nameless_file(envs.fdcore_home(), f"fdcore-{self.instance}-weights.r{rank}")
            for rank in range(workers.tensor_parallel_size)
        }

    def _kv_files(self) -> dict[str, int]:
        """One empty shared-memory file per worker process place for its KV cache (``cache.shared_memory``),
        which the worker sizes and writes and its successor (the promoted spare, a restart) maps as it is:
        every block computed before a crash is still there, and the cache manager keeps pointing at them."""
        if not kv_outlives_workers(self.config):
            return {}
        return {
            spec.id: os.memfd_create(f"fdcore-{self.instance}-kv.{spec.id}", os.MFD_CLOEXEC)
            for spec in self.specs
            if spec.kind == "worker"
        }

    # ------------------------------------------------------------------ ipc
    def _create_ipc(self) -> None:
        removed = names.sweep()
        if removed:
            log("swept", objects=len(removed))
        self._check_shared_memory()
        names.claim_instance(self.instance)
        try:
            self._create_segments()
        except NoSharedMemory as exc:  # (filled by someone else since the check)
            raise StartFailure(
                f"{exc.strerror}; this tree needs {shared_memory_line(self.config, self._group_bytes())}"
            ) from None

    def _check_shared_memory(self) -> None:
        """Refuse to start, with one line, where /dev/shm cannot hold the tree's segments: they are
        committed at creation, so a start that passes this never meets SIGBUS for lack of room."""
        group = self._group_bytes()
        need, _ = topology.shared_memory_need(self.config, group)
        free = free_bytes()
        if need > free:
            raise StartFailure(
                f"{SHM_DIR} has {free:,} bytes free; this tree needs "
                f"{shared_memory_line(self.config, group)}"
                " (make /dev/shm larger, or lower supervisor.ring_capacity or engine.max_clients)"
            )

    def _group_bytes(self) -> int:
        """The worker group's communicator segment (0 without one)."""
        from fdcore.ipc.allreduce import ShmCommunicator

        shape = self._group_shape()
        return 0 if shape is None else ShmCommunicator.segment_size(*shape)

    def _group_shape(self) -> tuple[int, int] | None:
        """(ranks, bytes a rank's slot) of the worker group's shared-memory communicator, sized from the
        checkpoint's shapes (its headers only: no weights are read here); None without one."""
        if self.config.workers.tensor_parallel_size == 1 or self.config.workers.communicator == "paddle":
            return None
        from fdcore.checkpoint import inspect_checkpoint
        from fdcore.models.tensor_parallel import communicator_capacity

        world = self.config.workers.tensor_parallel_size
        return world, communicator_capacity(inspect_checkpoint(model_path(self.config)), self.config.scheduler, world)

    def _create_segments(self) -> None:
        self.board = HealthBoard.create(topology.health_name(self.instance), len(self.specs))
        capacity = self.config.supervisor.ring_capacity
        own = Inbox.create(
            topology.inbox_name(self.instance, topology.SUPERVISOR), [s.id for s in self.specs], capacity=capacity
        )
        self.inboxes.append(own)
        for spec in self.specs:
            inbox = Inbox.create(topology.inbox_name(self.instance, spec.id), list(spec.producers), capacity=capacity)
            self.inboxes.append(inbox)
            self.senders[spec.id] = Sender(Ring.attach(inbox.link_name(topology.SUPERVISOR)))
        for client in topology.client_ids(self.config):
            self.inboxes.append(Inbox.create(topology.inbox_name(self.instance, client), ["engine"], capacity=capacity))
        self.step_ring = BroadcastRing.create(
            [topology.inbox_name(self.instance, worker) for worker in topology.worker_ids(self.config)],
            capacity,
            name=topology.step_ring_name(self.instance),
        )
        if self.config.workers.tensor_parallel_size > 1:
            self._renew_group()

    def _renew_group(self) -> None:
        """Before a worker group starts (no rank runs): a fresh communicator. The shared-memory one's
        generations are zeroed (the new group counts its collectives from 0); a paddle.distributed
        group gets a new rendezvous port (FDCORE_GROUP_MASTER in the ranks' environment)."""
        if self.config.workers.tensor_parallel_size == 1:
            return
        if self.config.workers.communicator == "paddle":
            from fdcore.models.tensor_parallel import free_port_block

            self.group_master = f"127.0.0.1:{free_port_block(self.config.workers.tensor_parallel_size + 1)}"
        elif self.group_comm is None:
            self._create_group_comm()
        else:
            self.group_comm.reset()

    def _create_group_comm(self) -> None:
        from fdcore.ipc.allreduce import ShmCommunicator

        self.group_comm = ShmCommunicator.create(topology.group_name(self.instance), *self._group_shape())

    def _destroy_ipc(self) -> None:
        for semaphore in self.standby_semaphores.values():
            semaphore.close()
        for sender in self.senders.values():
            sender.close()
        for inbox in self.inboxes:
            inbox.close()
        if self.step_ring is not None:
            self.step_ring.close()
        if self.board is not None:
            self.board.close()
        if self.group_comm is not None:
            self.group_comm.close()
        names.unlink_instance(self.instance)
