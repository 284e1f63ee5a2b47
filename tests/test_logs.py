"""fdcore's logging: one logger per module under ``fdcore``, on the stderr of the moment, events machine-readable."""

from __future__ import annotations

from fdcore import logs
from fdcore.supervisor.events import log


def test_an_event_is_one_key_value_line_and_a_diagnostic_its_message(capsys):
    log("restarted", id="worker0", pid=12, reason="killed by SIGKILL", note="")
    logs.logger("fdcore.actors.worker").info("worker0: weights kept private: a reason")
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        'fdcore.supervisor: event=restarted id=worker0 pid=12 reason="killed by SIGKILL" note=""',
        "worker0: weights kept private: a reason",
    ]


def test_the_handler_is_installed_once_however_many_modules_ask():
    for name in ("fdcore.a", "fdcore.b", "fdcore.a"):
        logs.logger(name)
    import logging

    assert sum(isinstance(h, logs._Stderr) for h in logging.getLogger("fdcore").handlers) == 1
