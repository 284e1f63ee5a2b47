"""Who runs, in which order, and who may send to whom: the actor tree as data.

Children start in this order (and stop in reverse): the cache manager and the
workers first (they hold state the scheduler needs), then the scheduler, then
the engine that clients talk to. Every actor has one inbox; each producer that
may send to it gets its own link (a single-producer ring) in that inbox.
"""

from __future__ import annotations

from fdcore.config import Config
from fdcore.ipc import names

SUPERVISOR = "supervisor"


def worker_ids(config: Config) -> list[str]:
    return [f"worker{i}" for i in range(config.workers.count)]


def child_ids(config: Config) -> list[str]:
    """Start order of the children."""
    return ["cache", *worker_ids(config), "scheduler", "engine", *(["api"] if config.server.enabled else [])]


def kind_of(child_id: str) -> str:
    return "worker" if child_id.startswith("worker") else child_id


def title_of(child_id: str) -> str:
    """The process title: fdcore:engine, fdcore:worker:0, ..."""
    if child_id.startswith("worker"):
        return f"fdcore:worker:{child_id[len('worker'):]}"
    return f"fdcore:{child_id}"


def client_ids(config: Config) -> list[str]:
    """The client slots: inboxes the engine answers on, each claimed by one client process."""
    return [f"client{i}" for i in range(config.engine.max_clients)]


def client_index(link: str) -> int | None:
    """The slot number of a client link ("client3" -> 3); None for an actor's link."""
    number = link.removeprefix("client")
    return int(number) if number != link and number.isdigit() else None


def standby_title(child_id: str) -> str:
    """A warm spare's title until it takes over: fdcore:standby:worker:0."""
    return title_of(child_id).replace("fdcore:", "fdcore:standby:", 1)


def producers_of(child_id: str, config: Config) -> list[str]:
    """The links of a child's inbox: everyone allowed to send to it."""
    links = {
        "cache": ["scheduler"],
        "scheduler": ["engine", "cache", *worker_ids(config)],
        "engine": ["scheduler", *client_ids(config)],
        "api": [],
    }
    return [SUPERVISOR, *links.get(child_id, ["scheduler"])]


def inbox_name(instance_id: str, child_id: str) -> str:
    return names.object_name(instance_id, child_id)


def health_name(instance_id: str) -> str:
    return names.object_name(instance_id, "health")
