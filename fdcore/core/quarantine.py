"""Poison-request quarantine: which requests the engine stops re-submitting after crashes.

Crash-resume re-submits every unfinished request after a crash. A request that itself makes an
actor raise would then crash each successor too, until the restart intensity stops the whole tree:
one bad request, a total outage. An actor that raises names the requests it was handling (a
``Suspects`` report from its crash handler); a request named by two consecutive reports from the
same kind of actor is convicted: the engine fails it alone and never re-submits it. A single
report convicts nobody (the request may have shared a step with the real culprit, or the crash may
be no request's fault); crashes that leave no report (a SIGKILL, the OOM killer) name nobody.
"""

from __future__ import annotations

from collections.abc import Iterable


class Quarantine:
    """The last crash report of each actor kind, and the verdicts that follow from the next one."""

    def __init__(self) -> None:
        self._last: dict[str, frozenset[int]] = {}

    def crashed(self, kind: str, seqs: Iterable[int]) -> set[int]:
        """Note that a ``kind`` actor crashed handling ``seqs``; returns the requests convicted now
        (named by this report and by the previous one of the same kind)."""
        if not kind:
            raise ValueError("a crash report needs the actor kind")
        named = frozenset(seqs)
        convicted = named & self._last.get(kind, frozenset())
        self._last[kind] = named
        return set(convicted)

    def forget(self, seq: int) -> None:
        """A request that finished or was failed can no longer be convicted (ids are not reused,
        but the sets should not grow forever)."""
        for kind, named in self._last.items():
            if seq in named:
                self._last[kind] = named - {seq}
