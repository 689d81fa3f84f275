"""Per-rank metrics without a collective, and straggler detection on rank 0.

Every rank appends one line per step to ``<run_dir>/ranks/metrics.rank<N>.jsonl`` (its own file, line-buffered:
no rank ever waits for another to report). Rank 0 tails the other ranks' files with non-blocking reads and
compares, step by step, each rank's **busy time**: the wall time between its previous record and this one, less
the parts of the step that wait for the other ranks (backward, where DDP reduces gradients, the optimizer step,
communication and evaluation). A rank that sleeps, loads data slowly or computes its forward slowly has a long
busy time; the ranks waiting for it do not. Under FSDP/TP the forward all-gathers also wait, so the straggler's
lag is seen only in part.

A rank whose busy time exceeds the median of all ranks by ``observability.straggler_fraction`` (and by at least
``straggler_min_s`` seconds) for ``straggler_steps`` steps in a row is reported as a ``straggler`` event, again
only after as many normal steps in a row: ``{"rank", "busy_s", "median_s", "ratio", "steps"}``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from crosstrain.checkpoint.atomic import disk_errors

#: keys of a step's metrics copied into the rank's record (when present).
RECORD_KEYS = ("step_time_s", "time_data_s", "time_forward_s", "time_backward_s", "time_comm_s",
               "time_optimizer_s", "peak_memory_bytes")
#: parts of a step that may wait for other ranks: not part of a rank's busy time.
_WAITING = ("time_backward_s", "time_optimizer_s", "time_comm_s", "time_eval_s")


def rank_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"metrics.rank{rank}.jsonl"


def busy_seconds(wall_s: float, metrics: dict[str, float]) -> float:
    """Wall time since the rank's previous step record less the parts of the step that wait for other ranks."""
    return max(0.0, wall_s - sum(float(metrics.get(k, 0.0)) for k in _WAITING))


class RankMetricsWriter:
    """Appends this rank's step record to its own file; ``resume_step`` drops records of rolled-back steps."""

    def __init__(self, run_dir: str | Path, rank: int, *, resume_step: int = 0) -> None:
        from crosstrain.engine.metrics import _drop_records_after

        self.rank = rank
        self.path = rank_file(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # records after the step it starts from (0: a fresh start) were rolled back
            _drop_records_after(self.path, resume_step)
        self._fh: TextIO | None = self.path.open("a", buffering=1)
        self._last: float | None = None

    def record(self, step: int, metrics: dict[str, float]) -> dict[str, Any]:
        now = time.perf_counter()
        # the first step of this process: setup time is no one's busy time
        wall = now - self._last if self._last is not None else float(metrics.get("step_time_s", 0.0))
        self._last = now
        record: dict[str, Any] = {"step": step, "rank": self.rank, "time": time.time()}
        record.update({k: float(metrics[k]) for k in RECORD_KEYS if k in metrics})
        record["busy_s"] = busy_seconds(wall, metrics)
        if self._fh is not None:
            with disk_errors(self.path):
                self._fh.write(json.dumps(record) + "\n")
        return record

    def close(self) -> None:
        if self._fh is not None:
            fh, self._fh = self._fh, None
            with disk_errors(self.path):  # the flush of a line a full disk refused
                fh.close()


class _Tail:
    """New complete lines of a file another process appends to (a partial last line waits for its end)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: Any = None
        self._partial = ""

    def lines(self) -> list[str]:
        if self._fh is None:
            if not self.path.exists():
                return []
            self._fh = self.path.open()
        text = self._partial + self._fh.read()
        *done, self._partial = text.split("\n")
        return done

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


class StragglerDetector:
    """Rank 0: reads every rank's busy times as they arrive and reports stragglers through ``emit``.

    ``emit(step, name, fields)`` is called with a ``straggler`` event; ``poll`` never blocks.
    """

    def __init__(self, run_dir: str | Path, world_size: int, emit: Callable[[int, str, dict[str, Any]], None], *,
                 fraction: float, steps: int, min_s: float) -> None:
        self.world_size = world_size
        self.emit = emit
        self.fraction, self.steps, self.min_s = fraction, steps, min_s
        self._tails = {r: _Tail(rank_file(run_dir, r)) for r in range(1, world_size)}
        self._busy: dict[int, dict[int, float]] = {}  # step -> rank -> busy_s
        self._streak = [0] * world_size
        self._reported = [False] * world_size
        self._calm = [0] * world_size
        self._next = 1  # the first step not yet judged

    def add(self, rank: int, step: int, busy_s: float) -> None:
        self._busy.setdefault(step, {})[rank] = busy_s

    def poll(self) -> None:
        for rank, tail in self._tails.items():
            for line in tail.lines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                self.add(rank, int(rec["step"]), float(rec.get("busy_s", 0.0)))
        for step in sorted(s for s, ranks in self._busy.items() if len(ranks) == self.world_size):
            self._judge(step, self._busy.pop(step))
        for step in [s for s in self._busy if s < self._next - 10 * self.steps]:  # lost records: forget them
            del self._busy[step]

    def _judge(self, step: int, busy: dict[int, float]) -> None:
        self._next = max(self._next, step + 1)
        median = statistics.median(busy.values())
        for rank, value in busy.items():
            slow = value > median * (1 + self.fraction) and value - median >= self.min_s
            self._streak[rank] = self._streak[rank] + 1 if slow else 0
            self._calm[rank] = 0 if slow else self._calm[rank] + 1
            if self._calm[rank] >= self.steps:  # a streak ends after as many normal steps as it took to start
                self._reported[rank] = False
            if slow and self._streak[rank] >= self.steps and not self._reported[rank]:
                self._reported[rank] = True
                self.emit(step, "straggler", {
                    "message": f"crosstrain: warning: rank {rank} is a straggler: busy {value:.3f}s a step vs the "
                               f"median {median:.3f}s for {self._streak[rank]} steps (up to step {step})",
                    "rank": rank, "busy_s": value, "median_s": median,
                    "ratio": value / median if median > 0 else float("inf"), "steps": self._streak[rank]})

    def close(self) -> None:
        for tail in self._tails.values():
            tail.close()


class RankMetrics:
    """What the loop calls once a step on every rank: write this rank's record; on rank 0 also judge stragglers."""

    @classmethod
    def for_run(cls, config: Any, run_dir: str | Path, rank: int, world_size: int,
                emit: Callable[[int, str, dict[str, Any]], None], resume_step: int) -> RankMetrics | None:
        """From ``[observability]`` (the observability plugin's section); None when ``per_rank`` is off or the
        plugin is not loaded."""
        obs = config.plugins.get("observability")
        if obs is None or not obs.per_rank:
            return None
        return cls(run_dir, rank, world_size, emit, resume_step=resume_step, fraction=obs.straggler_fraction,
                   steps=obs.straggler_steps, min_s=obs.straggler_min_s)

    def __init__(self, run_dir: str | Path, rank: int, world_size: int,
                 emit: Callable[[int, str, dict[str, Any]], None], *, resume_step: int = 0, fraction: float = 0.5,
                 steps: int = 5, min_s: float = 0.01) -> None:
        self.writer = RankMetricsWriter(run_dir, rank, resume_step=resume_step)
        self.detector = None
        if rank == 0 and world_size > 1:
            self.detector = StragglerDetector(run_dir, world_size, emit, fraction=fraction, steps=steps, min_s=min_s)

    def step_end(self, step: int, metrics: dict[str, float]) -> None:
        record = self.writer.record(step, metrics)
        if self.detector is not None:
            self.detector.add(0, step, record["busy_s"])
            self.detector.poll()

    def close(self) -> None:
        """Judge the other ranks' last records, then close (idempotent)."""
        if self.detector is not None:
            self.detector.poll()
            self.detector.close()
            self.detector = None
        self.writer.close()
