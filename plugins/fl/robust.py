"""Defences against a malicious-but-authenticated client: update checks, norm bounds and robust aggregates.

Plain mode sees each update, so :func:`update_problem` refuses a non-finite one or one above ``fl.clip_norm``,
:func:`norm_outliers` one far above the round's median norm (in secure mode: the norms the clients report), and
:func:`aggregate` can take the coordinate-wise median or trimmed mean instead of the weighted mean (Yin et al.
2018, "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates", ICML, section 3). Secure mode
sees only the sum, so :func:`secure_mean_bound` bounds what an honest sum can be and the round fails beyond it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from crosstrain.plugins.fl.config import FLSection, trimmed_count

#: relative slack on norm checks: a client's float32 clipping lands a few ulps above the bound.
NORM_SLACK = 1e-5


def _over_bound(norm: float, bound: float) -> bool:
    return bound > 0 and norm > bound * (1 + NORM_SLACK)


def update_problem(fl: FLSection, header: dict[str, Any], update: np.ndarray | None) -> str | None:
    """Why the server refuses this ``train`` reply, or None. ``update`` is the vector (plain mode) or None (secure
    mode, where only the norm the client reports can be checked)."""
    if update is not None:
        bad = int(np.count_nonzero(~np.isfinite(update)))
        if bad:
            return f"update has {bad} non-finite values of {update.size}"
        norm = float(np.linalg.norm(update.astype(np.float64)))
    else:
        value = header.get("norm")
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            return f"reported update norm {value!r} is not a finite non-negative number"
        norm = float(value)
    if _over_bound(norm, fl.clip_norm):
        return f"update norm {norm:.4g} exceeds fl.clip_norm={fl.clip_norm:g}"
    return None


def norm_outliers(norms: dict[int, float], ratio: float) -> dict[int, str]:
    """Clients whose update norm is above ``ratio`` times the median of the round's norms, and why. Honest
    clients train the same model for the same steps at the same rate, so their norms are alike and a scaled-up
    update stands out; the median needs 3 or more updates to be an honest one's (with 2 it is their mean)."""
    if ratio <= 0 or len(norms) < 3:
        return {}
    median = float(np.median(list(norms.values())))
    return {c: f"update norm {n:.4g} is above fl.max_norm_ratio={ratio:g} times the round's median {median:.4g}"
            for c, n in sorted(norms.items()) if median > 0 and n > ratio * median}


def trimmed_mean(updates: np.ndarray, trim: int) -> np.ndarray:
    """Coordinate-wise ``trim``-trimmed mean of the rows of ``updates``: per coordinate, drop the ``trim`` largest
    and ``trim`` smallest values and average the rest (Yin et al. 2018, Definition 2; ``trim = beta n``)."""
    n = updates.shape[0]
    if not 0 <= 2 * trim < n:
        raise ValueError(f"cannot trim {trim} of {n} updates at each end")
    ordered = np.sort(updates, axis=0)
    return ordered[trim:n - trim].mean(axis=0, dtype=np.float64)


def aggregate(fl: FLSection, updates: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
    """The plain round's aggregate of ``updates`` (one row per client) by ``fl.aggregation``, and its stats.

    ``mean`` is FedAvg's weighted mean (McMahan et al. 2017); ``median`` and ``trimmed_mean`` are unweighted and
    coordinate-wise (Yin et al. 2018): one client among ``n`` moves a median coordinate at most to a neighbouring
    honest value, whatever it sends.
    """
    if fl.aggregation == "median":
        return np.median(updates, axis=0).astype(np.float32), {"trimmed": 0}
    if fl.aggregation == "trimmed_mean":
        trim = trimmed_count(updates.shape[0], fl.trim_fraction)
        return trimmed_mean(updates, trim).astype(np.float32), {"trimmed": trim}
    mean = (weights[:, None] * updates).sum(0) / weights.sum()
    return mean.astype(np.float32), {}


def secure_mean_bound(norms: list[float], survivors: int, step: float, dim: int, total_weight: float) -> float:
    """The largest L2 norm the SecAgg+ mean of honest clients can have.

    A weighted mean is a convex combination, so ``||sum w_i x_i / W|| <= max_i ||x_i||``; coordinate-wise clipping
    only shrinks each ``w_i x_i``; stochastic rounding moves each client's coordinate by less than one grid step,
    so the mean's coordinates by less than ``survivors * step / W``: the bound is
    ``max_i ||x_i|| + survivors * step * sqrt(dim) / W`` over the norms the survivors reported.
    """
    return max(norms) + survivors * step * math.sqrt(dim) / total_weight


def secure_problem(mean: np.ndarray, norms: list[float], weights: list[float], stats: dict[str, Any],
                   step: float, total_weight: float) -> str | None:
    """Why the SecAgg+ aggregate cannot come from the updates the survivors described (their reported norms and
    weights), or None: then a client masked something else, and the round must not be applied."""
    if not np.isfinite(mean).all():
        return "the secure aggregate has non-finite values"
    if stats.get("overflowed", 0):
        return f"{stats['overflowed']} summed coordinates overflowed the grid (impossible from honest clients)"
    reported = sum(weights)
    if abs(total_weight - reported) > 1e-3 * reported:  # the weight word's grid error is ~2**-24 of max_weight
        return f"the securely summed weight {total_weight:.6g} differs from the reported {reported:.6g}"
    norm = float(np.linalg.norm(mean.astype(np.float64)))
    bound = secure_mean_bound(norms, len(norms), step, mean.size, total_weight)
    if _over_bound(norm, bound):
        return (f"the secure aggregate has norm {norm:.4g}, above {bound:.4g}, the most the survivors' reported "
                "norms allow: a client masked an update other than the one it reported")
    return None
