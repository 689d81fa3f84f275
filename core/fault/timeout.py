"""Collectives that fail with one clear line naming the operation, the rank and the timeout.

A dead or hung peer makes a torch.distributed call raise a backend error after the process group's timeout
(gloo: "Timed out waiting ... for recv", "Connection closed by peer"). :func:`guarded` turns it into a
:class:`~crosstrain.errors.CollectiveError` that says which collective, on which rank, after how long.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from crosstrain.errors import CollectiveError, first_line

F = TypeVar("F", bound=Callable[..., Any])


def _seconds(timeout: float | datetime.timedelta | None) -> float | None:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return timeout


def _error(op: str, rank: int, timeout: float | datetime.timedelta | None, start: float,
           exc: BaseException) -> CollectiveError:
    elapsed = time.monotonic() - start
    limit = _seconds(timeout)
    first = first_line(exc)
    peer = any(w in first.lower() for w in ("timed out", "timeout", "connection", "closed", "reset", "peer"))
    return CollectiveError(
        f"collective {op} on rank {rank} failed after {elapsed:.1f}s"
        + (f" (timeout {limit:g}s)" if limit is not None else "")
        + f": {first}"
        + (" -- a peer process probably died or hung; check the other ranks' logs" if peer else "")
    )


def guarded(op: str) -> Callable[[F], F]:
    """Decorate a ``Collective`` method so backend failures raise :class:`CollectiveError` naming ``op`` and the rank.

    The success path costs one ``time.monotonic()`` call; the rank is looked up only on failure.
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return fn(self, *args, **kwargs)
            except CollectiveError:
                raise
            except RuntimeError as exc:  # DistBackendError / DistNetworkError are RuntimeErrors
                raise _error(op, getattr(self, "rank", -1), getattr(self, "timeout", None), start, exc) from exc

        return inner  # type: ignore[return-value]

    return wrap
