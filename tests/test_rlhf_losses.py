"""Closed-form values and float64 gradchecks of crosstrain.plugins.rlhf.losses."""

import math

import pytest
import torch

from crosstrain.plugins.rlhf.losses import (
    bradley_terry_loss,
    dpo_loss,
    preference_accuracy,
    sequence_logps,
    sft_loss,
    strict_accuracy,
)


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_sequence_logps_sums_masked_tokens():
    logits = torch.zeros(1, 3, 4)  # uniform: every token has log-prob -log 4
    labels = torch.tensor([[0, 1, 2]])
    mask = torch.tensor([[0, 1, 1]])
    total, length = sequence_logps(logits, labels, mask)
    assert total.item() == pytest.approx(-2 * math.log(4))
    assert length.item() == 2


def test_sft_loss_is_the_mean_over_completion_tokens_per_sequence():
    nll = torch.tensor([[5.0, 1.0, 3.0], [9.0, 9.0, 2.0]])
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]])
    assert sft_loss(nll, mask).tolist() == [2.0, 2.0]
    assert sft_loss(nll, torch.zeros_like(mask)).tolist() == [0.0, 0.0]  # no completion token: no loss


def test_bradley_terry_closed_form():
    rc, rr = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    loss = bradley_terry_loss(rc, rr)
    assert loss.tolist() == pytest.approx([-math.log(_sig(1.0)), -math.log(_sig(-1.0))])
    with_margin = bradley_terry_loss(rc, rr, margin=torch.tensor([0.5, 0.0]), center_coefficient=0.01)
    assert with_margin.tolist() == pytest.approx([-math.log(_sig(0.5)) + 0.01 * 9, -math.log(_sig(-1.0)) + 0.01 * 1])


# pc, pr, rc, rr; h = (pc - rc) - (pr - rr) = (-4 - -5) - (-6 - -5) = 2
LOGPS = (torch.tensor([-4.0]), torch.tensor([-6.0]), torch.tensor([-5.0]), torch.tensor([-5.0]))


@pytest.mark.parametrize("loss_type,eps,expected", [
    ("sigmoid", 0.0, -math.log(_sig(0.2))),
    ("cdpo", 0.1, -0.9 * math.log(_sig(0.2)) - 0.1 * math.log(_sig(-0.2))),
    ("hinge", 0.0, 1 - 0.2),
    ("robust", 0.1, (-0.9 * math.log(_sig(0.2)) + 0.1 * math.log(_sig(-0.2))) / 0.8),
])
def test_dpo_closed_form(loss_type, eps, expected):
    loss, chosen, rejected = dpo_loss(*LOGPS, beta=0.1, loss_type=loss_type, label_smoothing=eps)
    assert loss.item() == pytest.approx(expected)
    assert chosen.item() == pytest.approx(0.1) and rejected.item() == pytest.approx(-0.1)


def test_ipo_averages_per_token():
    lengths = (torch.tensor([2.0]), torch.tensor([4.0]))
    loss, chosen, rejected = dpo_loss(*LOGPS, *lengths, beta=0.5, loss_type="ipo")
    h = (-4 / 2 + 5 / 2) - (-6 / 4 + 5 / 4)  # 0.5 + 0.25
    assert loss.item() == pytest.approx((h - 1 / (2 * 0.5)) ** 2)
    assert chosen.item() == pytest.approx(0.5 * 1.0) and rejected.item() == pytest.approx(0.5 * -1.0)  # summed
    with pytest.raises(ValueError, match="lengths"):
        dpo_loss(*LOGPS, beta=0.5, loss_type="ipo")


def test_accuracies_count_ties():
    rc, rr = torch.tensor([1.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 0.0])
    assert preference_accuracy(rc, rr).tolist() == [1.0, 0.5, 0.0]
    assert strict_accuracy(rc, rr).tolist() == [1.0, 0.0, 0.0]


def test_equal_policy_and_reference_is_log_2():
    x = torch.tensor([-3.0, -7.0])
    loss, _, _ = dpo_loss(x, x, x, x, beta=0.1)
    assert loss.tolist() == pytest.approx([math.log(2)] * 2)


@pytest.mark.parametrize("loss_type", ["cdpo", "hinge", "ipo", "robust"])
def test_dpo_gradcheck(loss_type):
    g = torch.Generator().manual_seed(0)
    pc, pr = (torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    rc, rr = (torch.randn(3, generator=g, dtype=torch.float64) for _ in range(2))
    lengths = torch.tensor([2.0, 3.0, 5.0], dtype=torch.float64)

    def f(a, b):
        return dpo_loss(a, b, rc, rr, lengths, lengths + 1, beta=0.7, loss_type=loss_type, label_smoothing=0.1)[0]

    assert torch.autograd.gradcheck(f, (pc, pr))


def test_bradley_terry_and_sft_gradcheck():
    g = torch.Generator().manual_seed(1)
    rc, rr = (torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda a, b: bradley_terry_loss(a, b, margin=0.3, center_coefficient=0.05),
                                    (rc, rr))
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[1, 2, 3], [4, 0, 1]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])

    def f(x):
        total, _ = sequence_logps(x, labels, mask)
        return total

    assert torch.autograd.gradcheck(f, (logits,))
    nll = torch.rand(2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: sft_loss(x, mask), (nll,))
