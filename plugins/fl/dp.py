"""Differential privacy for federated updates: per-client clipping, Gaussian noise and an RDP accountant.

DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models"): each client clips
its update to L2 norm ``C`` (:func:`clip_update`), so one client changes the sum by at most ``C``; Gaussian noise
of std ``z C`` on the sum (:func:`add_gaussian_noise`) makes each round a Gaussian mechanism with noise
multiplier ``z``. The noise is added centrally by the server to the sum, or distributed: each of ``n`` clients
adds std ``z C / sqrt(n)`` before masking, so the secure sum carries std ``z C`` (with fewer survivors, less:
account with the smallest number expected to survive). :func:`epsilon` assumes every round sees every client
(no subsampling amplification), so it is an upper bound for sampled rounds.
"""

from __future__ import annotations

import math

import numpy as np

from crosstrain.errors import ConfigError


def clip_update(vec: np.ndarray, max_norm: float) -> tuple[np.ndarray, bool]:
    """``vec * min(1, max_norm / ||vec||_2)`` and whether it was scaled down (Abadi et al. 2016, eq. in sec. 3.1)."""
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise ConfigError(f"dp clip norm {max_norm} must be a positive finite number")
    norm = float(np.linalg.norm(np.asarray(vec, dtype=np.float64)))
    if not math.isfinite(norm):
        raise ValueError("the update has non-finite values; fix the local step before clipping")
    if norm <= max_norm:
        return vec, False
    return (vec * (max_norm / norm)).astype(vec.dtype, copy=False), True


def add_gaussian_noise(vec: np.ndarray, std: float, rng: np.random.Generator) -> np.ndarray:
    """``vec + N(0, std**2 I)``, drawn from ``rng``, in ``vec``'s dtype."""
    if not (math.isfinite(std) and std >= 0):
        raise ConfigError(f"dp noise std {std} must be a non-negative finite number")
    return (vec + rng.normal(0.0, std, size=vec.shape)).astype(vec.dtype, copy=False)


def _check(noise_multiplier: float, rounds: int, delta: float) -> None:
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ConfigError(f"dp noise_multiplier={noise_multiplier} must be positive (no noise gives no privacy)")
    if rounds < 1:
        raise ConfigError(f"dp rounds={rounds} must be at least 1")
    if not 0 < delta < 1:
        raise ConfigError(f"dp delta={delta} must lie in (0, 1); the usual choice is below 1 / number of clients")


def epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    """(eps, delta)-DP of ``rounds`` Gaussian mechanisms with noise multiplier ``z`` (sensitivity 1 after clipping).

    The Gaussian mechanism is ``(alpha, alpha / (2 z**2))``-RDP for every ``alpha > 1`` (Mironov 2017,
    "Renyi Differential Privacy", Prop. 7); ``T`` rounds compose to ``alpha T / (2 z**2)`` (Prop. 1); RDP gives
    ``eps = eps_RDP(alpha) + log(1/delta) / (alpha - 1)`` (Prop. 3). Minimising over ``alpha`` in closed form
    (``alpha* = 1 + z sqrt(2 log(1/delta) / T)``): ``eps = T / (2 z**2) + sqrt(2 T log(1/delta)) / z``.
    """
    _check(noise_multiplier, rounds, delta)
    z, log_inv_delta = noise_multiplier, math.log(1 / delta)
    return rounds / (2 * z * z) + math.sqrt(2 * rounds * log_inv_delta) / z


def noise_multiplier(target_epsilon: float, rounds: int, delta: float) -> float:
    """The smallest ``z`` with ``epsilon(z, rounds, delta) <= target_epsilon``: :func:`epsilon` solved for ``z``
    (a quadratic in ``1/z``: ``(T/2) a**2 + sqrt(2 T log(1/delta)) a - eps = 0``)."""
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ConfigError(f"dp target epsilon={target_epsilon} must be positive")
    _check(1.0, rounds, delta)
    b = math.sqrt(2 * rounds * math.log(1 / delta))
    a = (-b + math.sqrt(b * b + 2 * rounds * target_epsilon)) / rounds
    return 1 / a
