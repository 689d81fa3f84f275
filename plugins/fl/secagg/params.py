"""The parameters of one SecAgg+ round and the planner that picks them (Bell et al. 2020, section 4)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from crosstrain.errors import ConfigError

RESOLUTION_BITS = 24  # grid points per client over [-clip, clip]: 2**24, float32's mantissa
STEP_OF_RMS = 2.0**-10  # the grid step may be at most this fraction of an update's root-mean-square coordinate


@dataclass(frozen=True)
class SecAggParams:
    """One round's settings. Sums are taken mod ``2**bits``; each client's coordinate, after weighting, is clipped
    to ``[-clip, clip]`` and rounded onto ``levels = (2**bits - 1) // num_clients`` steps, so the sum of all
    ``num_clients`` contributions never wraps. Weights must lie in ``(0, max_weight]``: the weight travels as one
    more securely summed coordinate on the grid ``[0, max_weight]``."""

    num_clients: int
    neighbours: int
    threshold: int
    bits: int
    clip: float
    max_weight: float = 1.0

    def __post_init__(self) -> None:
        n, s, t = self.num_clients, self.neighbours, self.threshold
        if n < 2:
            raise ConfigError(f"secagg num_clients={n}: secure aggregation needs at least 2 clients")
        if not 1 <= s <= n - 1:
            raise ConfigError(f"secagg neighbours={s} must lie in [1, num_clients - 1 = {n - 1}]")
        if s % 2 and n % 2:
            raise ConfigError(f"secagg neighbours={s} must be even when num_clients={n} is odd (circulant graph)")
        if not s // 2 < t <= s:
            raise ConfigError(f"secagg threshold={t} must lie in [{s // 2 + 1}, neighbours={s}] (more than half "
                              "of the neighbours, so no minority of them can rebuild both of a client's secrets)")
        if not 8 <= self.bits <= 62:
            raise ConfigError(f"secagg bits={self.bits} must lie in [8, 62]")
        if self.levels < 2:
            raise ConfigError(f"secagg bits={self.bits} leaves no headroom for {n} clients; raise bits above "
                              f"{math.ceil(math.log2(n)) + 1}")
        for name in ("clip", "max_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"secagg {name}={value} must be a positive finite number")

    @property
    def levels(self) -> int:
        """Grid steps per client: the largest ``L`` with ``num_clients * L < 2**bits``."""
        return (2**self.bits - 1) // self.num_clients

    @property
    def dtype(self) -> np.dtype:
        """The word type that holds a value mod ``2**bits`` (wrapping arithmetic in it is exact mod 2**bits)."""
        return np.dtype(np.uint32 if self.bits <= 32 else np.uint64)

    @classmethod
    def plan(cls, num_clients: int, expected_dropout: float, update_norm: float, dim: int,
             max_weight: float = 1.0, abort_risk: float = 1e-3) -> tuple[SecAggParams, str]:
        """Pick ``s``, ``t``, ``bits`` and ``clip``; return them and the reasons in one line.

        - ``t = s // 2 + 1`` (a majority of the neighbourhood, Bell et al. 2020);
        - ``s``: the smallest valid size from ``2 ceil(log2 n)`` up (their O(log n)) for which the chance that
          some client keeps fewer than ``t`` live neighbours, ``n * P[Binomial(s, dropout) > s - t]``, is at most
          ``abort_risk``; the complete graph when none is;
        - ``bits = ceil(log2 n) + 24``: 2**24 grid steps per client, with headroom for n summands;
        - ``clip = min(norm, rms L / 2**11)`` with ``rms = norm / sqrt(dim)``: no coordinate of a weighted
          update of L2 norm at most ``update_norm`` can exceed ``norm``, so nothing clips unless the grid would
          get coarser than ``2**-10 rms`` per step; then the range shrinks to keep that resolution.
        """
        n = num_clients
        if n < 2:
            raise ConfigError(f"secagg num_clients={n}: secure aggregation needs at least 2 clients")
        if not 0 <= expected_dropout < 0.5:
            raise ConfigError(f"secagg expected_dropout={expected_dropout} must lie in [0, 0.5): the threshold "
                              "is a majority of the neighbours, so half of them must stay")
        if not (math.isfinite(update_norm) and update_norm > 0) or dim < 1:
            raise ConfigError(f"secagg plan needs update_norm > 0 and dim >= 1 (got {update_norm}, {dim})")

        def risk(s: int) -> float:
            t = s // 2 + 1
            tail = sum(math.comb(s, k) * expected_dropout**k * (1 - expected_dropout) ** (s - k)
                       for k in range(s - t + 1, s + 1))
            return min(1.0, n * tail)

        candidates = [s for s in range(1, n) if not (s % 2 and n % 2)]
        start = min(2 * math.ceil(math.log2(n)), n - 1)
        chosen = next((s for s in candidates if s >= start and risk(s) <= abort_risk), candidates[-1])
        t = chosen // 2 + 1
        bits = min(62, math.ceil(math.log2(n)) + RESOLUTION_BITS)
        levels = (2**bits - 1) // n
        clip = min(update_norm, update_norm / math.sqrt(dim) * levels * STEP_OF_RMS / 2)
        params = cls(n, chosen, t, bits, clip, max_weight)
        graph = "complete graph" if chosen == n - 1 else f"s >= 2 ceil(log2 {n}) = {start}"
        why = (f"s={chosen} ({graph}), t={t} (majority): a round aborts with probability {risk(chosen):.2g} at "
               f"dropout {expected_dropout} (target {abort_risk:g}); bits={bits}: 2**24 steps per client with "
               f"headroom for {n} summands; clip={clip:.4g} = "
               + ("the norm bound (nothing clips)" if clip == update_norm else "widest range with step 2**-10 rms")
               + f", step {2 * clip / params.levels:.3g}")
        return params, why
