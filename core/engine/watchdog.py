"""Hang dumps: when no step completes within ``observability.hang_dump_s``, every rank writes all its threads'
Python stacks (``faulthandler``) to ``<run_dir>/hangs/stacks.rank<N>.txt`` and rank 0 records a ``hang`` event.

The timeout must be shorter than ``fault.collective_timeout_s``, so the stacks are written while the ranks are
still waiting, before the collective timeout ends the run. The watcher is a daemon thread that needs the GIL: a
rank blocked in a collective or in I/O releases it; a rank stopped (SIGSTOP) or spinning in C code that holds
it writes nothing, and the other ranks' stacks show where they wait for it. One dump per stall: the next
completed step re-arms it.
"""

from __future__ import annotations

import faulthandler
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crosstrain.errors import ConfigError


def _hang_dump_s(config: Any) -> float:
    """``observability.hang_dump_s`` (the observability plugin's section); 0 (off) without the plugin."""
    obs = config.plugins.get("observability")
    return float(obs.hang_dump_s) if obs is not None else 0.0


def check_hang_dump(config: Any) -> None:
    """Raises ConfigError unless ``hang_dump_s`` is off (0) or below the collective timeout."""
    limit, timeout = _hang_dump_s(config), config.fault.collective_timeout_s
    if limit and limit >= timeout:
        raise ConfigError(f"observability.hang_dump_s = {limit:g} must be shorter than fault.collective_timeout_s = "
                          f"{timeout:g}, or the collective timeout ends the run first; lower it (or 0 = off)")


class HangWatchdog:
    """``beat(step)`` after every step; a thread dumps the stacks once the last beat is ``timeout_s`` old."""

    @classmethod
    def for_run(cls, config: Any, run_dir: Path, rank: int, emit: Callable[[int, str, dict[str, Any]], None],
                step: int) -> HangWatchdog | None:
        limit = _hang_dump_s(config)
        return cls(run_dir, rank, limit, emit, step) if limit else None

    def __init__(self, run_dir: Path, rank: int, timeout_s: float, emit: Callable[[int, str, dict[str, Any]], None],
                 step: int = 0) -> None:
        self.path = Path(run_dir) / "hangs" / f"stacks.rank{rank}.txt"
        self.rank, self.timeout_s, self.emit = rank, timeout_s, emit
        self._step, self._last, self._dumped = step, time.monotonic(), False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="crosstrain-hang-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        self._step, self._last, self._dumped = step, time.monotonic(), False

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            stalled = time.monotonic() - self._last
            if stalled >= self.timeout_s and not self._dumped:
                self._dumped = True
                self.dump(stalled)

    def dump(self, stalled: float) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(f"--- rank {self.rank}: no step completed for {stalled:.1f}s after step {self._step} "
                     f"({time.strftime('%Y-%m-%d %H:%M:%S')}) ---\n")
            fh.flush()
            faulthandler.dump_traceback(file=fh, all_threads=True)
        self.emit(self._step, "hang", {
            "message": f"crosstrain: warning: no step completed for {stalled:.0f}s after step {self._step}; every "
                       f"rank's Python stacks are in {self.path.parent}", "stalled_s": stalled,
            "dump": str(self.path.parent)})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
