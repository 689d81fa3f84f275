"""``crosstrain distill cache``'s progress: a line on stderr when a split starts, about every
:data:`EVERY_S` seconds while it runs (samples done, elapsed, an estimate of what is left) and when it ends; stdout
keeps the one JSON result line."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

EVERY_S = 10.0
PREFIX = "crosstrain: distill cache:"


class ProgressLine:
    """Prints ``crosstrain: distill cache: ...`` lines; :meth:`counter` makes a split's per-batch callback."""

    def __init__(self, every_s: float = EVERY_S) -> None:
        self.every_s = every_s
        self.start = time.perf_counter()

    def __call__(self, text: str) -> None:
        print(f"{PREFIX} {text}", file=sys.stderr, flush=True)

    def counter(self, name: str, total: int) -> Callable[[int], None]:
        """A ``on_batch(done)`` callback for ``total`` samples of split ``name``."""
        begun = last = time.perf_counter()
        self(f"{name}: 0/{total} samples")

        def on_batch(done: int) -> None:
            nonlocal last
            now = time.perf_counter()
            if done < total and now - last < self.every_s:
                return
            last = now
            took = now - begun
            left = took / max(done, 1) * (total - done)
            tail = f", about {left:.0f} s left" if done < total else ", done"
            self(f"{name}: {done}/{total} samples ({100 * done / max(total, 1):.0f}%), {took:.1f} s{tail}")

        return on_batch

