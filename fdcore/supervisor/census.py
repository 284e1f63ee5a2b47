"""A running tree's actor processes, found by their titles (tools, tests and chaos runs check that each actor
runs as exactly one process after every restart)."""

from __future__ import annotations

from fdcore.actors import topology


def actor_pid(supervisor_pid: int, child_id: str) -> int | None:
    """The live process of one actor of a running tree, found by its title (tools, tests, chaos)."""
    pids = actor_processes(supervisor_pid).get(topology.title_of(child_id), [])
    return pids[0] if pids else None


def actor_processes(supervisor_pid: int) -> dict[str, list[int]]:
    """The supervisor's live children by process title (fdcore:engine: [pid], ...): a healthy tree
    has exactly one per actor, whatever restarts it went through."""
    import psutil

    found: dict[str, list[int]] = {}
    for child in psutil.Process(supervisor_pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                found.setdefault(child.cmdline()[0], []).append(child.pid)
        except (psutil.NoSuchProcess, IndexError):
            continue
    return found


def actor_census(supervisor_pid: int, child_ids: list[str]) -> str:
    """'' when every actor runs as exactly one process, else what is wrong ('2 fdcore:engine
    (pids ...)', '0 fdcore:cache'): what chaos runs and tests check after each restart."""
    found = actor_processes(supervisor_pid)
    wrong = [(title, found.get(title, [])) for title in map(topology.title_of, child_ids)]
    return ", ".join(f"{len(pids)} {title} (pids {pids})" for title, pids in wrong if len(pids) != 1)
