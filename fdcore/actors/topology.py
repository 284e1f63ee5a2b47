"""Who runs, in which order, and who may send to whom: the actor tree as data.

Children start in this order (and stop in reverse): the cache manager and the
workers first (they hold state the scheduler needs), then the scheduler, then
the engine that clients talk to. Every actor has one inbox; each producer that
may send to it gets its own link (a single-producer ring) in that inbox.
"""

from __future__ import annotations

import os

from fdcore import envs
from fdcore.actors import health
from fdcore.config import Config
from fdcore.ipc import names
from fdcore.supervision import ChildSpec

SUPERVISOR = "supervisor"
WORKERS = "workers"  # the worker group as one addressee: every rank reads each step from one ring


class ActorKind:
    """What runs an actor kind, and whether its restart loses request state (the engine then
    starts a new epoch and re-submits every unfinished request: crash-resume)."""

    def __init__(self, actor_class: str, stateful: bool):
        self.actor_class = actor_class  # "module:Class"
        self.stateful = stateful


KINDS = {
    "cache": ActorKind("fdcore.actors.cache:CacheActor", stateful=True),
    "worker": ActorKind("fdcore.actors.worker:WorkerActor", stateful=True),
    "scheduler": ActorKind("fdcore.actors.scheduler:SchedulerActor", stateful=True),
    "engine": ActorKind("fdcore.actors.engine:EngineActor", stateful=False),
    "api": ActorKind("fdcore.server.actor:ApiActor", stateful=False),
}


def worker_ids(config: Config) -> list[str]:
    """The worker group's ranks, rank 0 first."""
    return [f"worker{i}" for i in range(config.workers.tensor_parallel_size)]


def worker_rank(child_id: str) -> int:
    """A worker's rank in its group ("worker1" -> 1)."""
    return int(child_id.removeprefix("worker"))


GROUP_MASTER_ENV = envs.GROUP_MASTER  # a paddle.distributed worker group's rendezvous host:port


def group_name(instance_id: str) -> str:
    """The worker group's shared-memory communicator (fdcore.ipc.allreduce)."""
    return names.object_name(instance_id, "group")


def api_ids(config: Config) -> list[str]:
    """The HTTP server's processes: "api", or "api0".."apiN-1" where ``server.processes`` > 1 (they
    share the port: one's death costs only its own connections)."""
    if not config.server.enabled:
        return []
    count = config.server.processes
    return ["api"] if count == 1 else [f"api{i}" for i in range(count)]


def child_ids(config: Config) -> list[str]:
    """Start order of the children."""
    return ["cache", *worker_ids(config), "scheduler", "engine", *api_ids(config)]


def child_specs(config: Config) -> list[ChildSpec]:
    """Every child as the supervisor starts it, in start order: id, kind, what runs it, who may
    send to it, whether its restart loses request state."""
    return [
        ChildSpec(
            cid,
            kind_of(cid),
            shutdown_timeout=config.supervisor.shutdown_timeout,
            actor_class=KINDS[kind_of(cid)].actor_class,
            producers=tuple(producers_of(cid, config)),
            stateful=KINDS[kind_of(cid)].stateful,
        )
        for cid in child_ids(config)
    ]


def kind_of(child_id: str) -> str:
    for numbered in ("worker", "api"):
        if child_id.startswith(numbered):
            return numbered
    return child_id


def title_of(child_id: str) -> str:
    """The process title: fdcore:engine, fdcore:worker:0, fdcore:api (fdcore:api:1 of several), ..."""
    kind = kind_of(child_id)
    if kind != child_id:
        return f"fdcore:{kind}:{child_id[len(kind) :]}"
    return f"fdcore:{child_id}"


def client_ids(config: Config) -> list[str]:
    """The client slots: inboxes the engine answers on, each claimed by one client process."""
    return [client_id(i) for i in range(config.engine.max_clients)]


def client_id(index: int) -> str:
    return f"client{index}"


def client_slot_path(instance_id: str, slot: int) -> str:
    """The file a client locks to claim a slot: the slot inbox's segment in /dev/shm. A lock on
    it is dropped by the kernel the moment its holder dies, which is what frees the slot."""
    return os.path.join(names.SHM_DIR, inbox_name(instance_id, client_id(slot)).lstrip("/"))


def client_index(link: str) -> int | None:
    """The slot number of a client link ("client3" -> 3); None for an actor's link."""
    number = link.removeprefix("client")
    return int(number) if number != link and number.isdigit() else None


def standby_title(child_id: str) -> str:
    """A warm spare's title until it takes over: fdcore:standby:worker:0."""
    return title_of(child_id).replace("fdcore:", "fdcore:standby:", 1)


def producers_of(child_id: str, config: Config) -> list[str]:
    """The links of a child's inbox: everyone allowed to send to it. (A worker's steps come by the
    group's broadcast ring instead: see :func:`broadcast_links`.)"""
    links = {
        "cache": ["scheduler"],
        "scheduler": ["engine", "cache", *worker_ids(config)],
        "engine": ["scheduler", *client_ids(config)],
        "api": [],
        "worker": [],
    }
    return [SUPERVISOR, *links[kind_of(child_id)]]


def step_ring_name(instance_id: str) -> str:
    """The ring the scheduler publishes each step to, once, for every rank of the worker group
    (fdcore.ipc.broadcast): reader i is rank i, woken through its inbox's doorbell."""
    return names.object_name(instance_id, "steps")


def broadcast_links(child_id: str, instance_id: str) -> list[tuple[str, str, int]]:
    """The broadcast rings a child reads beside its inbox's links: (producer, ring, reader index)."""
    if kind_of(child_id) == "worker":
        return [("scheduler", step_ring_name(instance_id), worker_rank(child_id))]
    return []


def inbox_name(instance_id: str, child_id: str) -> str:
    return names.object_name(instance_id, child_id)


def link_name(instance_id: str, to: str, producer: str) -> str:
    """The ring ``producer`` sends to ``to`` by (one single-producer ring per link)."""
    return f"{inbox_name(instance_id, to)}.{producer}"


def is_engine_inbox(entry: names.ShmEntry) -> bool:
    """Whether a /dev/shm entry is an instance's engine inbox (its segment or its semaphore): the
    object whose presence tells a client that an instance is there to connect to."""
    return entry.posix_name == inbox_name(entry.instance_id, "engine")


def health_name(instance_id: str) -> str:
    return names.object_name(instance_id, "health")


def shared_memory_need(config: Config, group_bytes: int = 0) -> tuple[int, int]:
    """What the supervisor creates in /dev/shm for this tree, as (bytes, objects): every inbox (its
    doorbell and a ring per link, each with its semaphore), the client slots, the step ring, the health
    board, the owner record, the spares' semaphores and ``group_bytes`` of a worker group's
    communicator. Each object takes whole pages (segments are committed at creation)."""
    from fdcore.ipc.broadcast import segment_size as broadcast_bytes
    from fdcore.ipc.ring_layout import HEADER_SIZE, round_capacity
    from fdcore.ipc.shm import segment_bytes

    ring = segment_bytes(HEADER_SIZE + round_capacity(config.supervisor.ring_capacity))
    page = segment_bytes(1)
    specs = child_ids(config)
    inboxes = [specs] + [producers_of(cid, config) for cid in specs] + [["engine"]] * config.engine.max_clients
    links = sum(len(producers) for producers in inboxes)
    objects = {
        "doorbells": (2 * page, len(inboxes)),
        "rings": (ring + page, links),
        "steps": (
            segment_bytes(broadcast_bytes(round_capacity(config.supervisor.ring_capacity), len(worker_ids(config))))
            + page,
            1,
        ),
        "health": (segment_bytes(health.board_bytes(len(specs))), 1),
        "owner": (page, 1),
        "spares": (page, len(worker_ids(config)) if config.workers.standby else 0),
        "group": (segment_bytes(group_bytes), 1 if group_bytes else 0),
    }
    return (
        sum(size * count for size, count in objects.values()),
        sum(count * (2 if name in ("doorbells", "rings", "steps") else 1) for name, (_, count) in objects.items()),
    )
