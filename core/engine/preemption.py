"""SIGTERM handling: the first signal asks the trainer to finish the step, save and exit 0; in multi-process
runs the ranks agree on it (:class:`StopVote`), so they all stop after the same step."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from typing import Any

import torch

#: multi-process runs agree on SIGTERM about this often (in seconds of training), measured after
#: VOTE_CALIBRATION_STEPS steps; until then they vote every step.
PREEMPT_CHECK_S = 0.5
VOTE_CALIBRATION_STEPS = 6


class PreemptionWatcher:
    """Sets :attr:`requested` on SIGTERM (a second SIGTERM falls back to the previous handler)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # second signal: stop waiting
            self.uninstall()
            signal.raise_signal(signum)
            return
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False


@dataclass
class _Vote:
    """One step's vote: the flags being all-reduced (None in one process) and the pending work."""

    flags: torch.Tensor | None
    work: Any
    local_save: bool

    def wait(self) -> list[float]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        assert self.flags is not None
        return self.flags.tolist()


class StopVote:
    """Whether any rank asked to stop, and whether rank 0's clock says a timed checkpoint is due: a two-element
    async all-reduce (max) that overlaps a training step. Only rank 0 votes for the save, so every rank saves
    after the same step whatever its own clock says (``checkpoint.every_minutes``).

    Multi-process runs vote every ``every`` steps, about every :data:`PREEMPT_CHECK_S` seconds once rank 0's
    median step time is known (after :data:`VOTE_CALIBRATION_STEPS` steps).
    """

    def __init__(self, collective: Any, watcher: PreemptionWatcher, device: torch.device) -> None:
        self.collective, self.watcher = collective, watcher
        self.comm_device = torch.device("cpu") if device.type == "cpu" else device
        self.every = 1

    def start(self, index: int, step_times: list[float], save_due: bool = False) -> _Vote | None:
        """Start this step's vote (``index``: steps run so far in this process; ``save_due``: this rank's clock
        says a timed checkpoint is due, heard from rank 0 only); None: no vote this step."""
        if self.collective.world_size == 1:
            return _Vote(None, None, save_due)
        if index == VOTE_CALIBRATION_STEPS:
            self._calibrate(step_times[1:])
        if index % self.every:
            return None
        save = save_due and self.collective.rank == 0
        flags = torch.tensor([float(self.watcher.requested), float(save)], device=self.comm_device)
        return _Vote(flags, self.collective.all_reduce(flags, op="max", async_op=True), save)

    def save_due(self, vote: _Vote | None) -> bool:
        """Whether rank 0's clock called a timed checkpoint this step: the same answer on every rank."""
        if vote is None:
            return False
        if vote.flags is None:  # one process: its own clock
            return vote.local_save
        return bool(vote.wait()[1] > 0)

    def finish(self, vote: _Vote | None) -> bool:
        """True when this rank (single process: a signal or a stop request until now) or any rank (a vote this
        step) asked to stop."""
        if vote is None:
            return False
        if vote.flags is None:
            return self.watcher.requested
        return bool(vote.wait()[0] > 0)

    def _calibrate(self, step_times: list[float]) -> None:
        """Once, on every rank at the same step: rank 0's median step time decides the voting interval."""
        median = torch.tensor([sorted(step_times)[len(step_times) // 2]], dtype=torch.float64, device=self.comm_device)
        self.collective.broadcast(median, src=0)
        self.every = max(1, int(PREEMPT_CHECK_S / max(float(median.item()), 1e-6)))
