"""Workers of ``crosstrain train --nproc`` die with their launcher.

torchelastic starts each worker in a session of its own, so a launcher killed with SIGKILL (which cannot
forward anything) used to leave its workers running, blocked in a collective, sharing the run dir with the
next job. Two guards, armed when a worker starts: on Linux ``PR_SET_PDEATHSIG`` makes the kernel send SIGKILL
the moment the launcher exits; everywhere a daemon thread checks once a second whether the worker has been
re-parented, and kills the worker if so. SIGKILL rather than SIGTERM: the launcher no longer holds the run-dir
lock, so a graceful save could race a new job; the newest committed checkpoint is intact either way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

#: set by the launcher for its workers: its PID (it also holds the run-dir lock on their behalf).
ENV_LAUNCHER_PID = "CROSSTRAIN_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1
POLL_S = 1.0

_launcher: int | None = None


def launcher_pid() -> int | None:
    """The PID of the launcher this process is a worker of, once :func:`watch_launcher` armed the guards."""
    return _launcher


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die() -> None:
    os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))


def _watch(parent: int) -> None:
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent:
            _die()


def watch_launcher() -> bool:
    """In a launcher's worker (``$CROSSTRAIN_LAUNCHER_PID`` set): die when the launcher does. Returns whether armed."""
    global _launcher
    # popped, so that processes this worker starts (which the launcher did not) never inherit it
    text = os.environ.pop(ENV_LAUNCHER_PID, "")
    if not text.isdigit():
        return False
    parent = _launcher = int(text)
    _set_pdeathsig(getattr(signal, "SIGKILL", signal.SIGTERM))
    if os.getppid() != parent:  # the launcher died before the signal was armed
        _die()
    threading.Thread(target=_watch, args=(parent,), name="crosstrain-parent-watch", daemon=True).start()
    return True
