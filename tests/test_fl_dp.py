"""The FL plugin's differential privacy (plugins/fl/dp.py): the RDP accountant against two independent routes
(numerical minimisation over the Renyi order, and the exact privacy curve of the Gaussian mechanism), its
inverse, clipping and noise."""

from __future__ import annotations

import math

import numpy as np
import pytest

from crosstrain.errors import ConfigError
from crosstrain.plugins.fl import dp

CASES = [(1.1, 100, 1e-5), (0.8, 10, 1e-6), (4.0, 1, 1e-3), (5.0, 10, 1e-5), (2.0, 1000, 1e-5)]


@pytest.mark.parametrize("z, rounds, delta", CASES)
def test_epsilon_is_the_rdp_bound_minimised_over_alpha(z, rounds, delta):
    # route 1: Mironov's conversion eps(alpha) = T alpha / (2 z^2) + log(1/delta) / (alpha - 1), on a fine grid
    alphas = 1 + np.logspace(-5, 5, 400001)
    grid = (rounds * alphas / (2 * z * z) + math.log(1 / delta) / (alphas - 1)).min()
    assert dp.epsilon(z, rounds, delta) == pytest.approx(grid, rel=1e-6)
    assert dp.epsilon(z, rounds, delta) < dp.epsilon(z, rounds + 1, delta)
    assert dp.epsilon(z * 1.1, rounds, delta) < dp.epsilon(z, rounds, delta)


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _exact_gaussian_epsilon(z: float, rounds: int, delta: float) -> float:
    """The exact eps of T Gaussian mechanisms (one with mu = sqrt(T) / z, Dong, Roth & Su 2019), from the analytic
    privacy curve delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu) (Balle & Wang 2018, Thm 8)."""
    mu = math.sqrt(rounds) / z

    def curve(eps: float) -> float:
        return _phi(mu / 2 - eps / mu) - math.exp(eps) * _phi(-mu / 2 - eps / mu)

    lo, hi = 0.0, 500.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if curve(mid) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize("z, rounds, delta", CASES)
def test_epsilon_bounds_the_exact_gaussian_privacy_curve(z, rounds, delta):
    # route 2: the RDP bound is an upper bound on the true eps, and not a loose one
    exact = _exact_gaussian_epsilon(z, rounds, delta)
    assert exact < dp.epsilon(z, rounds, delta) < 1.7 * exact


def test_noise_multiplier_inverts_epsilon_and_bad_inputs():
    z = dp.noise_multiplier(3.0, 50, 1e-5)
    assert dp.epsilon(z, 50, 1e-5) == pytest.approx(3.0, rel=1e-9)
    for bad in ((0.0, 10, 1e-5), (1.0, 0, 1e-5), (1.0, 10, 1.0)):
        with pytest.raises(ConfigError):
            dp.epsilon(*bad)
    with pytest.raises(ConfigError):
        dp.noise_multiplier(-1.0, 10, 1e-5)


def test_clip_and_noise():
    rng = np.random.default_rng(0)
    v = rng.normal(size=1000).astype(np.float32)
    clipped, was = dp.clip_update(v, 2.0)
    assert was and clipped.dtype == np.float32 and np.linalg.norm(clipped) == pytest.approx(2.0, rel=1e-6)
    assert np.allclose(clipped / np.linalg.norm(clipped), v / np.linalg.norm(v), atol=1e-6)
    same, was = dp.clip_update(v, 1e3)
    assert not was and same is v
    with pytest.raises(ConfigError):
        dp.clip_update(v, 0.0)
    noisy = dp.add_gaussian_noise(np.zeros(200_000, np.float32), 0.5, np.random.default_rng(1))
    assert noisy.dtype == np.float32
    assert abs(noisy.std() - 0.5) < 5 * 0.5 / math.sqrt(2 * noisy.size) and abs(noisy.mean()) < 5 * 0.5 / 447
    assert np.array_equal(noisy, dp.add_gaussian_noise(np.zeros(200_000, np.float32), 0.5,
                                                       np.random.default_rng(1)))
