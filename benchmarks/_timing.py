"""Timing shared by the benchmarks: a clock read at the end of every training step, ABBA alternation of the
things compared, and the seconds of a call.

Import it as ``_timing`` (a benchmark runs as a script, so its folder is on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class StepClock:
    """Readings of ``clock`` (wall time by default) taken by :meth:`tick` at the end of every step."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.readings: list[float] = []

    def tick(self) -> None:
        self.readings.append(self.clock())

    @property
    def intervals(self) -> list[float]:
        """The time between consecutive step ends: one step's time, everything done per step included."""
        return [b - a for a, b in itertools.pairwise(self.readings)]


@contextlib.contextmanager
def step_clock(clock: Callable[[], float] = time.perf_counter) -> Iterator[StepClock]:
    """A :class:`StepClock` ticked by the ``crosstrain_on_step_end`` hook of every Trainer run inside the block.

    The hook runs after the other plugins' (``trylast``), so what they do at a step's end counts in that step.
    """
    from crosstrain import hookimpl, pluginmanager

    ends = StepClock(clock)

    class _Plugin:
        @hookimpl(trylast=True)
        def crosstrain_on_step_end(self, context: Any, step: int, metrics: dict[str, float]) -> None:
            ends.tick()

    name = f"benchmark-step-clock-{id(ends)}"
    pluginmanager.register(_Plugin(), name=name)
    try:
        yield ends
    finally:
        pluginmanager.unregister(name)


def alternate(names: Sequence[str], rounds: int, run: Callable[[str, int], T]) -> dict[str, list[T]]:
    """``run(name, round)`` for every name in each of ``rounds`` rounds, in order in even rounds and reversed in
    odd ones (ABBA), so a drift of the machine's speed hits every name alike. Each name's results in round order."""
    results: dict[str, list[T]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else list(reversed(names)):
            results[name].append(run(name, r))
    return results


def seconds(fn: Callable[[], Any], calls: int = 1) -> float:
    """Wall seconds per call of ``fn``, over ``calls`` calls in a row."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls
