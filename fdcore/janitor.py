"""The janitor (fdcore:janitor): removes an instance's shared memory once its supervisor is gone, however.

The supervisor unlinks every object of its instance as it stops; a supervisor that is SIGKILLed (or
dies of the OOM killer) cannot. Its actors die with it (``PR_SET_PDEATHSIG``), but their segments and
semaphores would stay in /dev/shm until some later fdcore start swept them. So the supervisor starts
this small process first, in a session of its own (a signal to the supervisor's process group does not
reach it), holding the read end of a pipe whose only write end the supervisor holds: the kernel closes
that end when the supervisor ends, the read returns end-of-file, and the janitor unlinks whatever of
the instance is left, then exits. After a clean stop there is nothing left to remove.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

TITLE = "fdcore:janitor"


def start(instance: str) -> tuple[subprocess.Popen, int]:
    """Start the janitor of ``instance``; returns it and the pipe's write end, which the caller must hold
    (close-on-exec: no child of the caller keeps it) until it has removed the instance itself."""
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fdcore.janitor", instance, str(read_fd)],
            pass_fds=(read_fd,),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    return proc, write_fd


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fdcore.janitor")
    parser.add_argument("instance")
    parser.add_argument("watch_fd", type=int)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the supervisor's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ends only with the supervisor (or SIGKILL)
    import setproctitle

    setproctitle.setproctitle(TITLE)
    while os.read(args.watch_fd, 64):
        pass
    from fdcore.ipc import names

    names.unlink_instance(args.instance)
    return 0


if __name__ == "__main__":
    sys.exit(main())
