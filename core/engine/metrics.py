"""Metrics sinks: every per-step metric and every event goes through :class:`MetricsHub` to each sink.

Built-in sinks: ``metrics.jsonl`` and ``events.jsonl`` in the run dir, the console (a rich progress bar on a
TTY, plain lines otherwise) and TensorBoard when it is installed. Plugins add sinks with
``crosstrain_metrics_sinks``: any object with ``write(step, metrics)`` and ``close()``, and optionally
``open(info: SinkInfo)`` (called once with the run dir, rank and resume step before the first record) and
``event(step, name, fields)`` (resume, rollback, preemption, checkpoint, plugin events).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from crosstrain.checkpoint.atomic import atomic_write, disk_errors
from crosstrain.checkpoint.space import NoSpaceError


class MetricsSink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SinkInfo:
    """What a sink learns about the run before its first record (``resume_step`` 0: a fresh run)."""

    run_dir: Path
    rank: int
    world_size: int
    resume_step: int


class EventsFileSink:
    """One JSON object per event in ``events.jsonl``: ``{"step", "event", "time", ...fields}``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fh: TextIO | None = self.path.open("a", buffering=1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def event(self, step: int, name: str, fields: dict[str, Any]) -> None:
        if self._fh is not None:
            record = {"step": step, "event": name, "time": time.time(), **fields}
            with disk_errors(self.path):  # a full disk is the one-line error, not a traceback
                self._fh.write(json.dumps(record, default=str) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            fh, self._fh = self._fh, None
            with disk_errors(self.path):  # the flush of a line a full disk refused
                fh.close()


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no nan/inf
    return value


class JsonlSink:
    """One JSON object per step in ``metrics.jsonl`` (flushed on every line, so a crash loses nothing).

    ``resume_step``: the run resumed from a checkpoint of that step, so records of later steps describe work
    that was rolled back; they are dropped (the file is replaced atomically) so that every step appears once,
    as TensorBoard's ``purge_step`` does for event files.
    """

    def __init__(self, path: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        if resume_step is not None and self.path.exists():
            _drop_records_after(self.path, resume_step)
        self._fh: TextIO | None = self.path.open("a", buffering=1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._fh is not None:
            record = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
            with disk_errors(self.path):
                self._fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            fh, self._fh = self._fh, None
            with disk_errors(self.path):  # the flush of a line a full disk refused
                fh.close()


def _drop_records_after(path: Path, step: int) -> None:
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by the crash
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
            continue
        kept.append(line + "\n")
    atomic_write(path, "".join(kept))


def format_line(step: int, total: int, m: dict[str, float], headline: tuple[str, ...] = (),
                eval_loss: float = float("nan")) -> str:
    """``step 10/240 | loss 3.2101 | eval 3.1920 | rewards/accuracies 0.7500 | lr 3.0e-03 | 41,200 tok/s | mfu 2.1%
    | 50 ms (...) | mem 412 MB``: ``eval`` the last eval loss (once there is one), then the recipe's headline
    metrics (:attr:`crosstrain.engine.recipe.Recipe.headline_metrics`) that the step reports."""
    parts = [f"step {step}/{total}", f"loss {m.get('loss', float('nan')):.4f}"]
    if math.isfinite(eval_loss):
        parts.append(f"eval {eval_loss:.4f}")
    parts += [f"{name} {m[name]:.4f}" for name in headline if name in m]
    parts.append(f"lr {m.get('lr', 0.0):.1e}")
    if "tokens_per_s" in m:
        parts.append(f"{m['tokens_per_s']:,.0f} tok/s")
    if "mfu" in m:
        parts.append(f"mfu {100 * m['mfu']:.1f}%")
    if "step_time_s" in m:
        detail = " ".join(f"{k[5:-2]} {1000 * v:.0f}" for k, v in m.items()
                          if k.startswith("time_") and k.endswith("_s"))
        parts.append(f"{1000 * m['step_time_s']:.0f} ms ({detail})" if detail else f"{1000 * m['step_time_s']:.0f} ms")
    if "peak_memory_bytes" in m:
        parts.append(f"mem {m['peak_memory_bytes'] / 2**20:,.0f} MB")
    if m.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return " | ".join(parts)


class PlainConsoleSink:
    """A line every ``every`` steps (and on the first and last step, on skipped steps and on eval steps), with
    the last eval loss and the recipe's ``headline`` metrics."""

    def __init__(self, total_steps: int, every: int, stream: TextIO | None = None,
                 headline: tuple[str, ...] = ()) -> None:
        self.total = total_steps
        self.every = every
        self.stream = stream or sys.stdout
        self.headline = headline
        self.eval_loss = float("nan")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        evaluated = "eval/loss" in metrics
        if evaluated:
            self.eval_loss = float(metrics["eval/loss"])
        if step == 1 or step % self.every == 0 or step == self.total or metrics.get("skipped") or evaluated:
            print(format_line(step, self.total, metrics, self.headline, self.eval_loss), file=self.stream,
                  flush=True)

    def close(self) -> None:
        pass


class RichProgressSink:
    """A rich progress bar with the latest loss, throughput and MFU."""

    def __init__(self, total_steps: int, start_step: int = 0, headline: tuple[str, ...] = ()) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.total = total_steps
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"), transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
        self.progress.start()
        self.headline = headline
        self.eval_loss = float("nan")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.eval_loss = float(metrics.get("eval/loss", self.eval_loss))
        info = f"loss {metrics.get('loss', float('nan')):.4f}"
        if math.isfinite(self.eval_loss):
            info += f" | eval {self.eval_loss:.4f}"
        info += "".join(f" | {name} {metrics[name]:.4f}" for name in self.headline if name in metrics)
        if "tokens_per_s" in metrics:
            info += f" | {metrics['tokens_per_s']:,.0f} tok/s"
        if "mfu" in metrics:
            info += f" | mfu {100 * metrics['mfu']:.1f}%"
        self.progress.update(self.task, completed=step, info=info)

    def close(self) -> None:
        self.progress.stop()


class TensorBoardSink:
    """Scalars to TensorBoard event files in ``<run_dir>/tensorboard``."""

    def __init__(self, log_dir: str | Path, *, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at or after it (from work rolled back by the resume) are dropped
        self.writer = SummaryWriter(str(log_dir), purge_step=None if resume_step is None else resume_step + 1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except Exception:
        return False
    return True


class MetricsHub:
    """Fans each step's metrics out to every sink; a failing plugin sink is reported once and dropped."""

    def __init__(self, sinks: list[Any] | None = None) -> None:
        self.sinks: list[Any] = list(sinks or [])
        self.opened = False

    def add(self, sink: Any) -> None:
        self.sinks.append(sink)

    def open(self, info: SinkInfo) -> None:
        """Tell every sink that has ``open`` about the run; later records and events go to all sinks."""
        for sink in list(self.sinks):
            if callable(getattr(sink, "open", None)):
                self._call(sink, "open", info)
        self.opened = True

    def _call(self, sink: Any, method: str, *args: Any) -> None:
        try:
            getattr(sink, method)(*args)
        except NoSpaceError:  # not the sink's fault: the run's checkpoints cannot be written either, so stop
            raise
        except Exception as exc:
            print(f"crosstrain: warning: metrics sink {type(sink).__name__} failed and is disabled: {exc}",
                  file=sys.stderr)
            self.sinks.remove(sink)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for sink in list(self.sinks):
            self._call(sink, "write", step, metrics)

    def event(self, step: int, name: str, fields: dict[str, Any]) -> None:
        """An event to every sink with an ``event`` method."""
        for sink in list(self.sinks):
            if callable(getattr(sink, "event", None)):
                self._call(sink, "event", step, name, fields)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:
                pass
        self.sinks = []
