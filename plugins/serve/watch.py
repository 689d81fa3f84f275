"""The ``--watch`` poller both servers share: which version serves, and a thread that loads each newer verified
checkpoint of the run (``--best``: each new best) beside it, gates it and swaps it in.

The swap is one attribute assignment: requests admitted afterwards run on the new version, work already under way
finishes on its own (Triton's model-repository polling and TorchServe's versions do the same without the gate).
Checkpoints are read only once committed and verified (:func:`crosstrain.checkpoint.verify.verify`, the SHA-256 of
every file): a ``step_N.tmp`` being written is never a candidate, and a ``step_N`` that fails its checksums is
refused like a failed gate. Subclasses say how a version loads and what its gate said
(:class:`~crosstrain.plugins.serve.manager.ModelManager`, :class:`~crosstrain.plugins.vision.serve.ImageManager`).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from crosstrain.checkpoint.manager import find_best, step_dirs
from crosstrain.checkpoint.resolve import Resolved
from crosstrain.checkpoint.verify import verify
from crosstrain.errors import CheckpointError, CrosstrainError


class Served(Protocol):
    """What the watcher reads of a version (its events name it by these)."""

    @property
    def number(self) -> int: ...
    @property
    def step(self) -> int | None: ...
    @property
    def source(self) -> str: ...
    @property
    def params_sha256(self) -> str | None: ...


V = TypeVar("V", bound=Served)


class Watcher(ABC, Generic[V]):
    """Holds the serving version ``current``; ``events`` keeps the last loads, swaps and refusals (also printed to
    stderr as ``crosstrain serve: {json}`` lines and passed to ``on_event``). ``run_dir``: the run polled after
    :meth:`start` (None: no watching)."""

    def __init__(self, *, best: bool, poll_s: float, on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.best, self.poll_s, self.on_event = best, poll_s, on_event
        self.events: deque[dict[str, Any]] = deque(maxlen=50)
        self._tried: set[tuple[int, str]] = set()  # (step, path) already loaded or refused
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.run_dir: Path | None = None
        self.current: V

    @abstractmethod
    def _load(self, resolved: Resolved, number: int) -> V:
        """Load version ``number`` from a checkpoint of the watched run (raise a CrosstrainError to refuse it)."""

    @abstractmethod
    def _gate(self, version: V) -> dict[str, Any]:
        """The serving gate's verdict on ``version``: at least ``passed`` and ``reason``."""

    def _serve_first(self, version: V) -> None:
        """Serve ``version`` (the one the command named), or refuse to start when it failed the gate."""
        verdict = self._gate(version)
        if not verdict["passed"]:
            raise CheckpointError(f"{version.source} failed the serving gate: {verdict['reason']}; pass another "
                                  "checkpoint")
        if version.step is not None:
            self._tried.add((version.step, version.source))
        self._event("loaded", version)
        self.current = version

    def start(self) -> None:
        if self.run_dir is not None:
            self._thread = threading.Thread(target=self._watch, name="crosstrain-serve-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as exc:  # a watcher that dies silently would stop updates: log and keep polling
                self._event("error", None, reason=f"{type(exc).__name__}: {exc}")

    def poll(self) -> V | None:
        """Look once for a newer checkpoint; load, gate and swap it in. Returns the new version, if any."""
        assert self.run_dir is not None
        for step, path in self._candidates(self.run_dir / "checkpoints"):
            self._tried.add((step, str(path)))
            if not self.best:  # find_best verified the best one already
                problems = verify(path).problems
                if problems:
                    self._event("refused", None, step=step, path=str(path), reason=f"verification: {problems[0]}")
                    continue
            try:
                version = self._load(Resolved("checkpoint", path, self.run_dir, step, True), self.current.number + 1)
            except CrosstrainError as exc:
                self._event("refused", None, step=step, path=str(path), reason=str(exc))
                continue
            verdict = self._gate(version)
            if not verdict["passed"]:
                self._event("refused", version, reason=verdict["reason"])
                continue
            self.current = version  # the swap: what is admitted from now on runs on it
            self._event("swapped", version)
            return version
        return None

    def _candidates(self, folder: Path) -> list[tuple[int, Path]]:
        current = self.current.step if self.current.step is not None else -1
        if self.best:
            info = find_best(folder)
            if info is None or info.step == current or (info.step, str(info.path)) in self._tried:
                return []
            return [(info.step, info.path)]
        return [(s, p) for s, p in step_dirs(folder) if s > current and (s, str(p)) not in self._tried]

    def _event(self, kind: str, version: V | None, **extra: Any) -> None:
        event: dict[str, Any] = {"event": kind, "time": time.time()}
        if version is not None:
            event.update(version=version.number, step=version.step, source=version.source,
                         params_sha256=version.params_sha256, gate=self._gate(version))
        event.update(extra)
        self.events.append(event)
        print(f"crosstrain serve: {json.dumps(event)}", file=sys.stderr, flush=True)
        if self.on_event is not None:
            self.on_event(event)
