"""The run's events and metrics on their way to the sinks (rank 0): ``metrics.jsonl``, ``events.jsonl``, the
console, TensorBoard and the plugins' sinks; an event emitted before the sinks open (the resume) waits for them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from crosstrain import pluginmanager
from crosstrain.checkpoint.atomic import atomic_write
from crosstrain.config import Config
from crosstrain.data.split import split_line
from crosstrain.engine.metrics import (
    EventsFileSink,
    JsonlSink,
    MetricsHub,
    PlainConsoleSink,
    RichProgressSink,
    SinkInfo,
    TensorBoardSink,
    tensorboard_available,
)


class Events:
    """Events and step metrics of one rank; only rank 0 writes them (every rank prints nothing else)."""

    def __init__(self, is_main: bool) -> None:
        self.is_main = is_main
        self.metrics = MetricsHub()
        self._early: list[tuple[int, str, dict[str, Any]]] = []

    def log(self, line: str) -> None:
        if self.is_main:
            print(line, file=sys.stderr, flush=True)

    def emit(self, step: int, name: str, fields: dict[str, Any]) -> None:
        """An event to every sink (kept until the sinks exist, e.g. the resume) and its message to stderr."""
        message = fields.get("message")
        if message:
            self.log(str(message))
        if not self.is_main:
            return
        if self.metrics.opened:
            self.metrics.event(step, name, fields)
        else:
            self._early.append((step, name, fields))

    def plugin_error(self, step: int, plugin: str, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}"
        message = f"crosstrain: warning: plugin {plugin!r} failed and was skipped: {error}"
        self.emit(step, "plugin_error", {"message": message, "plugin": plugin, "error": error, "fatal": False})

    def open_sinks(
        self, config: Config, run_dir: Path, world_size: int, resume_step: int, data_split: dict[str, Any],
        headline: tuple[str, ...] = (),
    ) -> None:
        """Rank 0: the run's sinks, opened at ``resume_step`` (a resumed run drops later records: rolled-back
        work), and ``data_split.json``; then the events that came early."""
        if not self.is_main:
            return
        cfg = config.logging
        # plugin sinks first: one that cannot start (a Prometheus port in use) stops the run before any file changes
        plugin_sinks = [
            sink
            for _, sinks in pluginmanager.call_each("crosstrain_metrics_sinks", config=config)
            for sink in sinks or []
        ]
        # a fresh start (step 0) drops the records of an attempt killed before its first checkpoint too
        self.metrics.add(JsonlSink(run_dir / "metrics.jsonl", resume_step=resume_step))
        self.metrics.add(EventsFileSink(run_dir / "events.jsonl"))
        if data_split:  # how the data was split into training and held-out parts
            atomic_write(run_dir / "data_split.json", (json.dumps(data_split, indent=2) + "\n").encode())
            if "train_tokens" in data_split:  # a token split: say what it holds out (stdout: news, not a warning)
                print(split_line(data_split), flush=True)
        mode = cfg.progress
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        if mode == "rich":
            self.metrics.add(RichProgressSink(config.train.steps, resume_step, headline=headline))
        elif mode == "plain":
            self.metrics.add(PlainConsoleSink(config.train.steps, cfg.every, headline=headline))
        if cfg.tensorboard and tensorboard_available():
            self.metrics.add(TensorBoardSink(run_dir / "tensorboard", resume_step=resume_step or None))
        for sink in plugin_sinks:
            self.metrics.add(sink)
        self.metrics.open(SinkInfo(run_dir=run_dir, rank=0, world_size=world_size, resume_step=resume_step))
        for step, name, fields in self._early:
            self.metrics.event(step, name, fields)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics.write(step, metrics)

    def close(self) -> None:
        self.metrics.close()
