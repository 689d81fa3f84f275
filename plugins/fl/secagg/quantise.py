"""Weighting, clipping and stochastic rounding of an update onto integers mod 2**bits, and back.

A client's coordinates become ``w x`` (its weight ``w`` times its update), clipped to ``[-clip, clip]``
(clipped coordinates are counted), mapped to ``z = (w x + clip) / (2 clip) * L`` with ``L = params.levels`` and
rounded stochastically, ``q = floor(z + u)``, ``u = k / 2**32`` with ``k`` a uniform 32-bit word of the
AES-256-CTR stream under ``SHA-256(rounding_seed)`` (OS entropy when the seed is None), which is unbiased,
``E[q] = z`` (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision"), up to the float64 rounding of
``z + u`` (relative 2**-53, so ``2**-28`` of a step at 28 bits). So
``q`` lies in ``[0, L]`` and ``num_clients`` of them sum below ``2**bits``: the modular sum is the true sum.
Two more words follow the vector: the weight on the grid ``[0, max_weight]`` and the count of clipped
coordinates (saturating at ``L`` per client; ``ClientSession.clipped`` keeps the exact local count), so the
server learns only the total weight and the total count. A summed coordinate beyond
``survivors * L`` (impossible from honest clients) is counted as overflowed, never silently used.
"""

from __future__ import annotations

import hashlib
import math
import os

import numpy as np

from crosstrain.plugins.fl.secagg import crypto
from crosstrain.plugins.fl.secagg.params import SecAggParams

EXTRA_WORDS = 2  # the weight and the clipped count, after the vector
_BLOCK = 1 << 15  # coordinates per pass: 256 KiB of float64, so the passes run in cache


def check_update(vector: np.ndarray, weight: float, params: SecAggParams) -> tuple[np.ndarray, np.ndarray]:
    """The update as a flat vector and its ``[min, max]``; ValueError naming the fix when it cannot be quantised."""
    x = np.asarray(vector).reshape(-1)
    if x.size == 0 or not np.issubdtype(x.dtype, np.number):
        raise ValueError(f"the update must be a non-empty numeric vector, got {x.size} values of {x.dtype}")
    ends = np.array([x.min(), x.max()])  # NaN propagates through min and max, inf shows in them
    if not np.isfinite(ends).all():
        raise ValueError(f"the update has {int((~np.isfinite(x)).sum())} non-finite values; fix the local step")
    if not 0 < weight <= params.max_weight:
        raise ValueError(f"weight={weight} must lie in (0, max_weight={params.max_weight}]; normalise the weights "
                         "or plan with a larger max_weight")
    return x, ends


def quantise(vector: np.ndarray, weight: float, params: SecAggParams,
             rounding_seed: int | None) -> tuple[np.ndarray, int]:
    """The words ``[q(w x)..., q(w), clipped]`` of one client (``params.dtype``) and its clipped count."""
    x, ends = check_update(vector, weight, params)
    levels, clip = params.levels, params.clip
    a, b = weight * levels / (2 * clip), levels / 2  # z = a x + b = (w x + clip) / (2 clip) * L
    low, high = np.multiply(ends, a, dtype=np.float64) + b  # monotone in x, as below: bounds on every z
    k = crypto.prg(_rounding_key(rounding_seed), x.size + 1, np.dtype(np.uint32))
    words = np.empty(x.size + EXTRA_WORDS, dtype=params.dtype)
    z, u = np.empty(_BLOCK), np.empty(_BLOCK)  # float64 scratch that stays in cache, reused block by block
    clipped = 0
    for start in range(0, x.size, _BLOCK):
        stop = min(start + _BLOCK, x.size)
        zb, ub = z[:stop - start], u[:stop - start]
        np.multiply(x[start:stop], a, out=zb, dtype=np.float64)
        zb += b
        if low < 0 or high > levels:
            clipped += int(np.count_nonzero(zb < 0) + np.count_nonzero(zb > levels))
            np.clip(zb, 0, levels, out=zb)
        np.multiply(k[start:stop], 2.0**-32, out=ub, dtype=np.float64)  # u in [0, 1) on a 2**-32 grid
        zb += ub
        words[start:stop] = zb  # truncation is floor, as z + u >= 0
    top = words[:-EXTRA_WORDS]
    np.minimum(top, levels, out=top)  # z + u can round up to L + 1 in float64 when z is near L
    words[-2] = min(math.floor(weight / params.max_weight * levels + float(k[-1]) * 2.0**-32), levels)
    words[-1] = min(clipped, levels)
    return words, clipped


def _rounding_key(rounding_seed: int | None) -> bytes:
    """The AES key of the rounding stream: fresh when no seed is given, else derived from the seed alone."""
    if rounding_seed is None:
        return os.urandom(crypto.KEY_BYTES)
    return hashlib.sha256(b"crosstrain-secagg/rounding/" + str(int(rounding_seed)).encode()).digest()


def dequantise(total: np.ndarray, survivors: int, params: SecAggParams) -> tuple[np.ndarray, float, dict[str, int]]:
    """``(weighted mean float32, total weight, stats)`` from the modular sum of ``survivors`` clients' words."""
    total = np.asarray(total)
    if total.dtype != params.dtype:
        total = total.astype(np.uint64)
    total = total & total.dtype.type(2**params.bits - 1)
    levels, clip = params.levels, params.clip
    overflowed = int(np.count_nonzero(total > survivors * levels))
    total_weight = float(total[-2]) * params.max_weight / levels
    if total_weight <= 0:
        raise ValueError("the surviving clients' total weight rounded to zero; plan with a smaller max_weight")
    sums = total[:-EXTRA_WORDS].astype(np.float64)  # then in place: (sums * 2 clip / L - survivors clip) / weight
    sums *= 2 * clip / levels
    sums -= survivors * clip
    sums /= total_weight
    stats = {"clipped": int(total[-1]), "overflowed": overflowed}
    return sums.astype(np.float32), total_weight, stats


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
