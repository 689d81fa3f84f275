"""Closed-form tests of the RL loss parts (plugins/rlhf/rl) on a 2-token toy policy: every value is computed by
hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from crosstrain.plugins.rlhf.rl.advantages import gae, group_advantages, rloo_advantages, whiten
from crosstrain.plugins.rlhf.rl.aggregate import aggregate
from crosstrain.plugins.rlhf.rl.kl import AdaptiveKLController, kl_estimate
from crosstrain.plugins.rlhf.rl.policy_loss import clipped_surrogate, clipped_value_loss, log_ratio

T = torch.tensor
# The toy policy: two tokens a, b. pi = (0.75, 0.25), pi_old = pi_ref = (0.5, 0.5).
PI, OLD = T([0.75, 0.25], dtype=torch.float64), T([0.5, 0.5], dtype=torch.float64)


def test_gae_closed_form() -> None:
    # row 0: r = (0, 1), V = (0.5, 0.25), gamma 0.9, lambda 0.8
    #   t=1: delta = 1 - 0.25 = 0.75 = A_1;  t=0: delta = 0.9 * 0.25 - 0.5 = -0.275, A_0 = -0.275 + 0.72 * 0.75 = 0.265
    # row 1: only t=0 valid: delta = 2 - 1 = 1 = A_0 (what lies past the mask is ignored)
    adv, ret = gae(T([[0.0, 1.0], [2.0, 5.0]]), T([[0.5, 0.25], [1.0, 7.0]]), T([[True, True], [True, False]]),
                   gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, T([[0.265, 0.75], [1.0, 0.0]]))
    torch.testing.assert_close(ret, T([[0.765, 1.0], [2.0, 0.0]]))


def test_group_advantages_closed_form() -> None:
    r = T([1.0, 0.0, 0.5, 0.5])  # two groups of 2: means 0.5 and 0.5; unbiased stds sqrt(0.5) and 0
    s = math.sqrt(0.5)
    torch.testing.assert_close(group_advantages(r, 2, "group", eps=1e-4),
                               T([0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.0, 0.0]))
    torch.testing.assert_close(group_advantages(r, 2, "batch", batch_std=0.5, eps=1e-4),
                               T([0.5 / 0.5001, -0.5 / 0.5001, 0.0, 0.0]))
    torch.testing.assert_close(group_advantages(r, 2, "none"), T([0.5, -0.5, 0.0, 0.0]))  # Dr. GRPO
    # RLOO, one group of 3: baselines (0 + 0.5)/2, (1 + 0.5)/2, (1 + 0)/2
    torch.testing.assert_close(rloo_advantages(T([1.0, 0.0, 0.5]), 3), T([0.75, -0.75, 0.0]))
    # whitening: mean 2, var 2/3 -> (x - 2) / sqrt(2/3)
    w = whiten(T([1.0, 2.0, 3.0, 9.0]), T([True, True, True, False]), 2.0, 2 / 3, eps=0.0)
    torch.testing.assert_close(w, T([-math.sqrt(1.5), 0.0, math.sqrt(1.5), 0.0]))


def _ratios() -> torch.Tensor:
    # sampled a: pi/pi_old = 0.75/0.5 = 1.5; sampled b: 0.25/0.5 = 0.5 -> per token log-ratios
    return torch.log(T([[PI[0] / OLD[0], PI[0] / OLD[0], PI[1] / OLD[1], PI[1] / OLD[1]]]))


def test_symmetric_clip_closed_form() -> None:
    adv = T([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    out = clipped_surrogate(_ratios(), adv, eps_low=0.2)
    # r=1.5,A=+1: -min(1.5, 1.2) = -1.2 (high clip) | r=1.5,A=-1: -min(-1.5, -1.2) = 1.5
    # r=0.5,A=-1: -min(-0.5, -0.8) = 0.8 (low clip) | r=0.5,A=+1: -min(0.5, 0.8) = -0.5
    torch.testing.assert_close(out.loss, T([[-1.2, 1.5, 0.8, -0.5]], dtype=torch.float64))
    assert out.clipped_high.tolist() == [[True, False, False, False]]
    assert out.clipped_low.tolist() == [[False, False, True, False]]
    assert not out.dual_clipped.any()


def test_clip_higher_and_dual_clip_closed_form() -> None:
    adv = T([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    out = clipped_surrogate(_ratios(), adv, eps_low=0.2, eps_high=0.28)  # DAPO: only the upper bound moves
    torch.testing.assert_close(out.loss, T([[-1.28, 1.5, 0.8, -0.5]], dtype=torch.float64))
    # dual clip c = 3 with pi_old(a) = 0.2, pi(a) = 0.8: r = 4, A = -1 -> -min(-4, -1.2) = 4 > 3 -> 3
    lr = torch.log(T([[0.8 / 0.2, 1.5]], dtype=torch.float64))
    out = clipped_surrogate(lr, T([[-1.0, -1.0]], dtype=torch.float64), eps_low=0.2, dual_clip=3.0)
    torch.testing.assert_close(out.loss, T([[3.0, 1.5]], dtype=torch.float64))
    assert out.dual_clipped.tolist() == [[True, False]]


def test_sequence_ratio_and_value_clip_closed_form() -> None:
    # GSPO: tokens a then b sampled with pi = (0.75, 0.25) vs old (0.5, 0.5): log s = (log 1.5 + log 0.5) / 2
    logps, old = torch.log(T([[0.75, 0.25, 0.9]])), torch.log(T([[0.5, 0.5, 0.1]]))
    mask = T([[True, True, False]])
    s = math.sqrt(1.5 * 0.5)
    torch.testing.assert_close(log_ratio(logps, old, mask, "sequence").exp() * mask, T([[s, s, 0.0]]))
    torch.testing.assert_close(log_ratio(logps, old, mask, "token"), T([[math.log(1.5), math.log(0.5), 0.0]]))
    # value clip: V 1.0, V_old 0.5, R 2, c 0.2: max((1-2)^2, (0.7-2)^2) / 2 = 0.845
    loss, hit = clipped_value_loss(T([1.0]), T([0.5]), T([2.0]), clip=0.2)
    torch.testing.assert_close(loss, T([0.845]))
    assert hit.tolist() == [True]


def test_kl_estimators_closed_form_and_unbiased_on_the_toy_policy() -> None:
    lp, ref = torch.log(PI), torch.log(OLD)  # per token: sampled a, sampled b
    # log r = log(ref/pi): a: log(2/3), b: log 2
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), T([math.log(1.5), -math.log(2)], dtype=torch.float64))
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"),
                               T([0.5 * math.log(2 / 3) ** 2, 0.5 * math.log(2) ** 2], dtype=torch.float64))
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"),
                               T([2 / 3 - 1 - math.log(2 / 3), 2 - 1 - math.log(2)], dtype=torch.float64))
    exact = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)  # KL(pi || ref) = 0.130812
    for est in ("k1", "k3"):  # unbiased: their expectation under pi is the exact KL
        assert float((PI * kl_estimate(lp, ref, est)).sum()) == pytest.approx(exact, abs=1e-12)
    assert kl_estimate(lp, ref, "k1", clamp=0.3).tolist() == pytest.approx([0.3, -0.3])
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)  # error clip(12/6 - 1) = 0.2
    assert ctl.update(12.0, 100) == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    assert AdaptiveKLController(0.1).update(12.0, 100) == 0.1  # target 0: fixed


@pytest.mark.parametrize("mode,expected", [("token-mean", 10 / 4), ("seq-mean-token-mean", (6 / 3 + 4) / 2),
                                           ("seq-mean-token-sum", 10 / 2), ("seq-mean-token-sum-norm", 10 / 6)])
def test_aggregation_closed_form(mode: str, expected: float) -> None:
    loss = T([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = T([[True, True, True], [True, False, False]])
    assert float(aggregate(loss, mask, mode, tokens=4, sequences=2, max_tokens=3)) == pytest.approx(expected)
    # as a share of a larger global batch: the same micro-batch counts half when the step has twice the data
    half = aggregate(loss, mask, mode, tokens=8, sequences=4, max_tokens=3)
    assert float(half) == pytest.approx(expected / 2)
