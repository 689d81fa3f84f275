"""The model manager: which version serves, and (with ``--watch``) the poller that loads each newer verified
checkpoint of the run beside it, gates it and swaps it in.

The swap is one attribute assignment read by the scheduler between decode steps: requests admitted afterwards
run on the new version, sequences already decoding finish on theirs (Triton's model-repository polling and
TorchServe's versions do the same without the gate). Checkpoints are read only once committed and verified
(:func:`crosstrain.checkpoint.verify.verify`, the SHA-256 of every file): a ``step_N.tmp`` being written is never
a candidate, and a ``step_N`` that fails its checksums is refused like a failed gate.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.manager import find_best, step_dirs
from crosstrain.checkpoint.resolve import Resolved
from crosstrain.checkpoint.verify import verify
from crosstrain.errors import CheckpointError, ConfigError, CrosstrainError
from crosstrain.plugins.serve.config import ServeOptions
from crosstrain.plugins.serve.versions import Version, load_version

log = logging.getLogger("crosstrain.serve")


class ModelManager:
    """Holds the serving version; ``events`` keeps the last loads, swaps and refusals (also printed to stderr)."""

    def __init__(self, options: ServeOptions, workdir: Path, on_event: Any = None) -> None:
        self.options = options
        self.workdir = workdir
        self.on_event = on_event
        self.events: deque[dict[str, Any]] = deque(maxlen=50)
        self._tried: set[tuple[int, str]] = set()  # (step, path) already loaded or refused
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.current = self._first()
        self.run_dir: Path | None = None
        if options.watch:
            self.run_dir = self._watched_run_dir()

    def _first(self) -> Version:
        version = load_version(self.options.source, 1, self.options.engine, self.options.max_batch, self.workdir,
                               best=self.options.best)
        if not version.gate.passed:
            raise CheckpointError(f"{version.source} failed the serving gate: {version.gate.reason}; pass another "
                                  "checkpoint")
        if version.step is not None:
            self._tried.add((version.step, version.source))
        self._event("loaded", version)
        return version

    def _watched_run_dir(self) -> Path:
        run_dir = _run_dir(Path(self.current.source))
        if run_dir is None:
            raise ConfigError(f"--watch follows a run, but {self.options.source} is not a run dir or one of its "
                              "checkpoints; pass the run dir")
        return run_dir

    # -- watching ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.run_dir is not None:
            self._thread = threading.Thread(target=self._watch, name="crosstrain-serve-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _watch(self) -> None:
        while not self._stop.wait(self.options.poll_s):
            try:
                self.poll()
            except Exception as exc:  # a watcher that dies silently would stop updates: log and keep polling
                self._event("error", None, reason=f"{type(exc).__name__}: {exc}")

    def poll(self) -> Version | None:
        """Look once for a newer checkpoint; load, gate and swap it in. Returns the new version, if any."""
        assert self.run_dir is not None
        folder = self.run_dir / "checkpoints"
        for step, path in self._candidates(folder):
            self._tried.add((step, str(path)))
            if not self.options.best:  # find_best verified the best one already
                problems = verify(path).problems
                if problems:
                    self._event("refused", None, step=step, path=str(path), reason=f"verification: {problems[0]}")
                    continue
            number = self.current.number + 1
            try:
                with _short_gil_slices():
                    version = load_version(Resolved("checkpoint", path, self.run_dir, step, True), number,
                                           self.options.engine, self.options.max_batch, self.workdir)
            except CrosstrainError as exc:
                self._event("refused", None, step=step, path=str(path), reason=str(exc))
                continue
            if not version.gate.passed:
                self._event("refused", version, reason=version.gate.reason)
                continue
            self.current = version  # the swap: the scheduler picks it up before its next decode step
            self._event("swapped", version)
            return version
        return None

    def _candidates(self, folder: Path) -> list[tuple[int, Path]]:
        current = self.current.step if self.current.step is not None else -1
        if self.options.best:
            info = find_best(folder)
            if info is None or info.step == current or (info.step, str(info.path)) in self._tried:
                return []
            return [(info.step, info.path)]
        return [(s, p) for s, p in step_dirs(folder) if s > current and (s, str(p)) not in self._tried]

    def _event(self, kind: str, version: Version | None, **extra: Any) -> None:
        event: dict[str, Any] = {"event": kind, "time": time.time()}
        if version is not None:
            event.update(version=version.number, step=version.step, source=version.source,
                         params_sha256=version.params_sha256, gate=version.gate.to_dict())
        event.update(extra)
        self.events.append(event)
        print(f"crosstrain serve: {json.dumps(event)}", file=sys.stderr, flush=True)
        if self.on_event is not None:
            self.on_event(event)


@contextmanager
def _short_gil_slices(seconds: float = 0.0005) -> Iterator[None]:
    """CPython's GIL switch interval at ``seconds`` (default 5 ms) while a version loads beside the serving one.

    Loading is mostly Python (checkpoint planning, the run config, plugin hooks), and the scheduler thread's decode
    step is many short torch calls, each re-taking the GIL: with 5 ms slices it waits up to 5 ms per call (the
    convoy effect). Measured on the tiny model with 16 rows while versions load in a loop: the slowest of 150
    decode steps 290 ms at 5 ms slices, 24 ms at 0.5 ms (median 0.58 ms either way; 12 ms with no load)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _run_dir(checkpoint: Path) -> Path | None:
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
