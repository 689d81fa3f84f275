"""Two real gloo ranks shared by the test session: ``run(fn, *args)`` is ``run_ranks(fn, 2, *args)`` without the
start-up each call of crosstrain.testing.multiprocess.run_ranks pays (see crosstrain.testing.rank_pool, which
says what a call may leave behind and when the ranks are replaced). Stopped when the session ends (conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from crosstrain.testing.rank_pool import RankPool

WORLD_SIZE = 2
_pool = RankPool(WORLD_SIZE)


def close() -> None:
    """Stop the shared ranks."""
    _pool.close()


def run(fn: Callable[..., Any], *args: Any, timeout: float = 180.0) -> list[Any]:
    """Call ``fn(collective, *args)`` on the shared 2 ranks; return the per-rank results in rank order."""
    return _pool.run(fn, *args, timeout=timeout)
