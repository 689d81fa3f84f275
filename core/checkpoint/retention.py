"""Which committed checkpoints to delete under ``keep_last`` / ``keep_every``."""

from __future__ import annotations

from collections.abc import Iterable


def to_delete(steps: Iterable[int], *, keep_last: int, keep_every: int, protect: Iterable[int] = ()) -> list[int]:
    """Steps to delete: all but the newest ``keep_last`` (``<= 0`` keeps all), multiples of ``keep_every``
    (``> 0``) and ``protect`` (e.g. the step just committed and the one ``latest`` names).

    The newest step is always kept, so retention can never delete the only checkpoint.
    """
    ordered = sorted(set(steps), reverse=True)
    if keep_last <= 0 or not ordered:
        return []
    keep = set(ordered[:max(keep_last, 1)]) | set(protect)
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    return sorted(s for s in ordered if s not in keep)
