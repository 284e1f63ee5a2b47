"""The supervisor: ``python -m fdcore.supervisor --config FILE.toml [--check]``.

It owns everything: every shared-memory object of the instance (created at
start, unlinked at exit), and every actor process, each started in a process
group of its own so that a kill reaches whatever the actor started too.

- Start: sweep the leftovers of dead instances, create the inboxes and the
  health board, start the children in order, each within ``start_timeout`` of
  reporting READY; a child that fails to start stops the whole tree with its
  error (never a wait forever, never a restart loop).
- Run: a child that exits, or hangs (health board), is handled by its restart
  type and the strategy (:mod:`fdcore.supervision`); too many restarts within
  the period stop the tree with a non-zero exit and the reason.
- Stop (SIGINT / SIGTERM): children in reverse order, each by a Stop message,
  then SIGTERM, then SIGKILL, ``shutdown_timeout`` apart. A second Ctrl-C kills
  at once. If the supervisor itself is SIGKILLed, the kernel SIGKILLs every
  actor (``PR_SET_PDEATHSIG``) and the next start sweeps the segments.

Events go to stderr as ``fdcore.supervisor: event=NAME key=value ...`` lines.
"""

from fdcore.supervisor.census import actor_census, actor_pid, actor_processes
from fdcore.supervisor.cli import describe_model, main
from fdcore.supervisor.events import log
from fdcore.supervisor.segments import nameless_file, shared_memory_line
from fdcore.supervisor.tree import Supervisor

__all__ = [
    "Supervisor",
    "actor_census",
    "actor_pid",
    "actor_processes",
    "describe_model",
    "log",
    "main",
    "nameless_file",
    "shared_memory_line",
]
