"""Weighting, clipping and stochastic rounding of an update onto integers mod 2**bits, and back.

A client's coordinates become ``w x`` (its weight ``w`` times its update), clipped to ``[-clip, clip]``
(clipped coordinates are counted), mapped to ``z = (w x + clip) / (2 clip) * L`` with ``L = params.levels`` and
rounded stochastically, ``q = floor(z + u)``, ``u ~ U[0, 1)`` from ``numpy.random.default_rng(rounding_seed)``,
which is unbiased, ``E[q] = z`` (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision"). So
``q`` lies in ``[0, L]`` and ``num_clients`` of them sum below ``2**bits``: the modular sum is the true sum.
Two more words follow the vector: the weight on the grid ``[0, max_weight]`` and the count of clipped
coordinates (saturating at ``L`` per client; ``ClientSession.clipped`` keeps the exact local count), so the
server learns only the total weight and the total count. A summed coordinate beyond
``survivors * L`` (impossible from honest clients) is counted as overflowed, never silently used.
"""

from __future__ import annotations

import numpy as np

from crosstrain.plugins.fl.secagg.params import SecAggParams

EXTRA_WORDS = 2  # the weight and the clipped count, after the vector


def quantise(vector: np.ndarray, weight: float, params: SecAggParams,
             rounding_seed: int | None) -> tuple[np.ndarray, int]:
    """The words ``[q(w x)..., q(w), clipped]`` of one client (``params.dtype``) and its clipped count."""
    x = np.asarray(vector).reshape(-1)
    if x.size == 0 or not np.issubdtype(x.dtype, np.number):
        raise ValueError(f"the update must be a non-empty numeric vector, got {x.size} values of {x.dtype}")
    if not np.isfinite(x).all():
        raise ValueError(f"the update has {int((~np.isfinite(x)).sum())} non-finite values; fix the local step")
    if not 0 < weight <= params.max_weight:
        raise ValueError(f"weight={weight} must lie in (0, max_weight={params.max_weight}]; normalise the weights "
                         "or plan with a larger max_weight")
    levels, clip = params.levels, params.clip
    rng = np.random.default_rng(rounding_seed)
    scale = levels / (2 * clip)
    z = np.multiply(x, weight * scale, dtype=np.float64)  # in place from here: one float64 buffer
    z += clip * scale  # z = (w x + clip) / (2 clip) * L, in [0, L] unless clipped
    clipped = int(np.count_nonzero(z < 0) + np.count_nonzero(z > levels))
    np.clip(z, 0, levels, out=z)
    z += rng.random(x.size)
    np.floor(z, out=z)
    np.minimum(z, levels, out=z)
    words = np.empty(x.size + EXTRA_WORDS, dtype=params.dtype)
    words[:-EXTRA_WORDS] = z
    words[-2] = min(np.floor(weight / params.max_weight * levels + rng.random()), levels)
    words[-1] = min(clipped, levels)
    return words, clipped


def dequantise(total: np.ndarray, survivors: int, params: SecAggParams) -> tuple[np.ndarray, float, dict[str, int]]:
    """``(weighted mean float32, total weight, stats)`` from the modular sum of ``survivors`` clients' words."""
    total = np.asarray(total, dtype=np.uint64) & np.uint64(2**params.bits - 1)
    levels, clip = params.levels, params.clip
    overflowed = int(np.count_nonzero(total > survivors * levels))
    sums = total[:-EXTRA_WORDS].astype(np.float64) * (2 * clip / levels) - survivors * clip
    total_weight = float(total[-2]) * params.max_weight / levels
    if total_weight <= 0:
        raise ValueError("the surviving clients' total weight rounded to zero; plan with a smaller max_weight")
    stats = {"clipped": int(total[-1]), "overflowed": overflowed}
    return (sums / total_weight).astype(np.float32), total_weight, stats


def modular_sum(words: list[np.ndarray], params: SecAggParams) -> np.ndarray:
    """The wrapping sum of same-shape word vectors (exact mod 2**bits, since 2**bits divides the word size)."""
    acc = np.zeros_like(words[0], dtype=params.dtype)
    for w in words:
        np.add(acc, w, out=acc)
    return acc


def plain_aggregate(vectors: list[np.ndarray], weights: list[float], params: SecAggParams,
                    rounding_seeds: list[int | None]) -> np.ndarray:
    """The weighted FedAvg mean with the same quantisation as the secure round but no masks (the reference)."""
    if not len(vectors) == len(weights) == len(rounding_seeds) >= 1:
        raise ValueError("plain_aggregate needs as many weights and rounding seeds as vectors (at least one)")
    words = [quantise(v, w, params, s)[0] for v, w, s in zip(vectors, weights, rounding_seeds, strict=True)]
    return dequantise(modular_sum(words, params), len(vectors), params)[0]
