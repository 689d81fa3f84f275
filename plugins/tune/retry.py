"""Trials that failed because of the machine, not their parameters: recognised, re-enqueued with the same
parameters (Optuna's ``enqueue_trial``), and not counted among the study's N trials.

A full disk, a process killed by the OOM killer or by hand, a lost rank: the same parameters on a healthy machine
would give a value, so such a failure says nothing about the point and must not use up the search. A failed trial
is recorded FAIL with the cause in its user attr ``environment_failure``; its retry is a new trial (its own run
dir) whose user attr ``retry_of`` names the first trial of the chain.
"""

from __future__ import annotations

import signal
from typing import Any

from crosstrain.fault.peer_loss import EXIT_PEER_LOST

#: trial user attrs
CAUSE, RETRY_OF = "environment_failure", "retry_of"

#: the text of a failure for want of disk space (crosstrain's NoSpaceError lines, OSError's strerror)
_NO_SPACE = ("no space left on device", "disk quota exceeded", "file too large", "file-size limit")
#: signals a rerun does not repeat: a kill (the OOM killer's SIGKILL, a stop sent by hand), a vanished mmap'd file
_KILLS = {"SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGBUS", "SIGXFSZ"}


#: a run dir's file system with less free space than this is full (its trial's own log may be empty)
FULL_BELOW = 1 << 20


def environment_cause(code: int | None, text: str, free: int | None) -> str | None:
    """Why a trial that exited with ``code`` (negative: killed by that signal; None: the tuner could not start it),
    whose last output line is ``text`` and whose run dir has ``free`` bytes left (None: unknown), failed because of
    its machine; None when the cause is its config or its code (a bad value, a NaN, a crash such as SIGSEGV), which
    the same parameters would repeat."""
    lowered = text.lower()
    if any(t in lowered for t in _NO_SPACE) or "errno 28" in lowered or "errno 122" in lowered or (
            free is not None and free < FULL_BELOW):
        return "no disk space"
    if code is not None and code < 0:
        name = _signal_name(-code)
        return f"killed by {name}" if name in _KILLS else None
    if code == EXIT_PEER_LOST or "lost another rank" in lowered:
        return "a rank was lost"
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def slots_taken(trials: list[Any]) -> int:
    """How many of the study's N trials ``trials`` use: all but environment failures (each is re-run as another
    trial with its parameters)."""
    return sum(CAUSE not in t.user_attrs for t in trials)


def enqueue_retry(study: Any, trial: Any) -> None:
    """Queue ``trial``'s parameters (a FrozenTrial that failed from the environment) as a new WAITING trial: the
    next ``study.ask()`` takes it before drawing a new point."""
    attrs = {RETRY_OF: trial.user_attrs.get(RETRY_OF, trial.number)}
    if trial.user_attrs.get("base_config"):
        attrs["base_config"] = True
    study.enqueue_trial(dict(trial.params), user_attrs=attrs, skip_if_exists=False)
