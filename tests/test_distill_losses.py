"""The distillation divergences (crosstrain.plugins.compress.distill.losses): closed forms on two-outcome
distributions, parity with TRL's GKD ``generalized_jsd_loss`` and torchtune's ``ForwardKLLoss`` on identical logits
(values and gradients; both re-derived below from their published code, neither package is a dependency), the
top-k tail bucket, and the chunked driver (equal to one chunk, and its autograd keeps no full-size fp32 tensor)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from crosstrain.plugins.compress.distill.losses import (
    TopK,
    distill_loss,
    divergence,
    forward_kl,
    generalized_jsd,
    reverse_kl,
    teacher_topk,
    token_divergence,
    with_tail,
)


def _two(p: float) -> torch.Tensor:
    return torch.tensor([math.log(p), math.log(1 - p)], dtype=torch.float64)


def _kl(a: float, b: float) -> float:  # KL(Bernoulli(a) || Bernoulli(b))
    return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))


@pytest.mark.parametrize("p,q", [(0.9, 0.3), (0.2, 0.6), (0.5, 0.5)])
def test_closed_forms_on_two_outcomes(p: float, q: float) -> None:
    t, s = _two(p), _two(q)
    assert forward_kl(t, s).item() == pytest.approx(_kl(p, q), abs=1e-12)
    assert reverse_kl(t, s).item() == pytest.approx(_kl(q, p), abs=1e-12)
    for beta in (0.1, 0.5, 0.9):
        m = beta * p + (1 - beta) * q  # Agarwal et al. 2024, eq. (1): the teacher's share of the mixture is beta
        want = beta * _kl(p, m) + (1 - beta) * _kl(q, m)
        assert generalized_jsd(t, s, beta).item() == pytest.approx(want, abs=1e-12)
    assert generalized_jsd(t, s, 0.0).item() == pytest.approx(_kl(p, q), abs=1e-12)  # TRL's end points
    assert generalized_jsd(t, s, 1.0).item() == pytest.approx(_kl(q, p), abs=1e-12)
    assert generalized_jsd(t, s, 0.5).item() <= math.log(2) + 1e-12  # the JSD's bound
    assert generalized_jsd(t, s, 0.5).item() == pytest.approx(generalized_jsd(s, t, 0.5).item(), abs=1e-12)


def test_temperature_scales_by_t_squared_of_softened_logits() -> None:
    """Hinton et al. 2015: soften both by T, multiply the divergence by T^2."""
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(1, 3, 7, generator=g), torch.randn(1, 3, 7, generator=g)
    mask = torch.ones(1, 3, dtype=torch.bool)
    got = distill_loss(s, t, mask, temperature=2.0)
    want = 4.0 * forward_kl(F.log_softmax(t / 2, -1), F.log_softmax(s / 2, -1)).mean()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def trl_generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0):
    """TRL's ``GKDTrainer.generalized_jsd_loss`` (trl/trainer/gkd_trainer.py, reduction="batchmean"), re-derived
    line by line from the published code."""
    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log(1 - beta), teacher_log_probs + torch.log(beta)]), dim=0)
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    mask = labels != -100
    jsd = jsd[mask]
    return jsd.sum() / mask.sum()


def torchtune_forward_kl(student_logits, teacher_logits, labels, ignore_index=-100):
    """torchtune's ``ForwardKLLoss.forward`` (torchtune/modules/loss/kd_losses.py, normalize=True), re-derived."""
    teacher_prob = F.softmax(teacher_logits, dim=-1, dtype=torch.float32)
    inf_mask = torch.isinf(student_logits)
    student_logprob = F.log_softmax(student_logits, dim=-1, dtype=torch.float32)
    prod_probs = torch.masked_fill(teacher_prob * student_logprob, inf_mask, 0)
    x = torch.sum(prod_probs, dim=-1).view(-1)
    mask = (labels != ignore_index).int()
    return -torch.sum(x * mask.view(-1), dim=0) / torch.sum(mask.view(-1), dim=0)


def _logits(seed: int = 0, b: int = 2, t: int = 9, v: int = 33) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s, tt = torch.randn(b, t, v, generator=g) * 2, torch.randn(b, t, v, generator=g) * 2
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, :3] = -100  # a prompt: not counted
    return s, tt, labels


@pytest.mark.parametrize("loss,beta", [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.5), ("jsd", 0.1),
                                       ("jsd", 0.0), ("jsd", 1.0)])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_parity_with_trl_generalized_jsd(loss: str, beta: float, temperature: float) -> None:
    s, t, labels = _logits()
    ours_in, trl_in = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
    mask = labels != -100
    ours = distill_loss(ours_in, t, mask, loss=loss, beta=beta, temperature=temperature, chunk_tokens=4)  # type: ignore[arg-type]
    theirs = trl_generalized_jsd_loss(trl_in, t, labels, beta=beta, temperature=temperature) * temperature**2
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours_in.grad, trl_in.grad, rtol=1e-5, atol=1e-7)


def test_forward_kl_parity_with_torchtune() -> None:
    """torchtune's ForwardKLLoss is the cross-entropy ``-sum p_T log q_S``: our forward KL minus the teacher's
    entropy term (no gradient), so equal values after that term and equal gradients."""
    s, t, labels = _logits(1)
    ours_in, tt_in = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
    mask = labels != -100
    ours = distill_loss(ours_in, t, mask, loss="forward_kl")
    theirs = torchtune_forward_kl(tt_in, t, labels)
    t_logp = F.log_softmax(t, -1)
    neg_entropy = ((t_logp.exp() * t_logp).sum(-1) * mask).sum() / mask.sum()
    assert ours.item() == pytest.approx((theirs + neg_entropy).item(), rel=1e-5)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours_in.grad, tt_in.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
def test_top_k_with_tail_bucket(loss: str) -> None:
    s, t, _ = _logits(2, v=17)
    flat_s, flat_t = s.reshape(-1, 17).double(), t.reshape(-1, 17).double()
    full = token_divergence(flat_s, flat_t, loss=loss)  # type: ignore[arg-type]
    every = token_divergence(flat_s, flat_t, loss=loss, top_k=17)  # type: ignore[arg-type]
    torch.testing.assert_close(every, full, rtol=1e-5, atol=1e-5)  # k = V: the tail is empty, nothing lost (fp32)
    for k in (1, 4, 12):
        top = token_divergence(flat_s, flat_t, loss=loss, top_k=k)  # type: ignore[arg-type]
        assert bool((top <= full + 1e-5).all())  # a coarsening never increases a divergence (data processing)
        assert bool((top >= -1e-6).all())
        cached = teacher_topk(flat_t, k)  # what `crosstrain distill cache` stores gives the same numbers
        torch.testing.assert_close(token_divergence(flat_s, TopK(cached.ids, cached.logps), loss=loss),  # type: ignore[arg-type]
                                   top.float(), rtol=1e-5, atol=1e-6)
    tail = with_tail(teacher_topk(flat_t, 4).logps)
    torch.testing.assert_close(tail.exp().sum(-1), torch.ones(tail.shape[0], dtype=tail.dtype))


def test_chunked_equals_one_shot_and_keeps_no_full_fp32_tensor() -> None:
    b, t, v = 2, 32, 512
    s, tt, labels = _logits(3, b, t, v)
    mask = labels != -100

    def one_shot(x: torch.Tensor) -> torch.Tensor:  # the formula applied to the whole [B*T, V] at once
        per_token = token_divergence(x.reshape(-1, v), tt.reshape(-1, v), loss="jsd", beta=0.5)
        return (per_token * mask.reshape(-1)).sum() / mask.sum()

    results, saved = [], []
    for fn in (one_shot, lambda x: distill_loss(x, tt, mask, loss="jsd", beta=0.5, chunk_tokens=8)):
        x = s.clone().requires_grad_(True)
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor, seen: dict[int, int] = storages) -> torch.Tensor:
            st = tensor.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x_: x_):
            out = fn(x)
        own = {x.untyped_storage().data_ptr(), tt.untyped_storage().data_ptr(), mask.untyped_storage().data_ptr()}
        saved.append(sum(n for ptr, n in storages.items() if ptr not in own))
        out.backward()
        results.append((out.item(), x.grad))
    full = b * t * v * 4
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-8)
    assert saved[0] >= 2 * full  # one shot: the backward keeps several [B*T, V] fp32 tensors
    assert saved[1] < full / 4  # chunked and recomputed: nothing of that size is kept for the backward


def test_divergence_names() -> None:
    t, s = _two(0.7), _two(0.4)
    assert divergence("forward_kl", t, s).item() == pytest.approx(_kl(0.7, 0.4))
    assert divergence("reverse_kl", t, s).item() == pytest.approx(_kl(0.4, 0.7))
    assert divergence("jsd", t, s, 0.3).item() == pytest.approx(generalized_jsd(t, s, 0.3).item())


def _vocab_parallel(collective: object) -> list[tuple[str, float, float, float]]:
    """On each of 2 ranks: the loss over this rank's half of the vocabulary (``group``) vs the whole rows."""
    import torch.distributed as dist

    rank = dist.get_rank()
    s, t, labels = _logits(4, 2, 6, 34)
    mask = labels != -100
    half = slice(rank * 17, (rank + 1) * 17)
    out = []
    for loss, beta in (("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)):
        full_in = s.clone().requires_grad_(True)
        full = distill_loss(full_in, t, mask, loss=loss, beta=beta, temperature=2.0)  # type: ignore[arg-type]
        full.backward()
        part_in = s[..., half].clone().requires_grad_(True)
        part = distill_loss(part_in, t[..., half].contiguous(), mask, loss=loss, beta=beta,  # type: ignore[arg-type]
                            temperature=2.0, chunk_tokens=5, group=dist.group.WORLD)
        part.backward()
        assert part_in.grad is not None and full_in.grad is not None
        out.append((loss, full.item(), part.item(), (part_in.grad - full_in.grad[..., half]).abs().max().item()))
    return out


def test_vocab_parallel_logits_give_the_whole_rows_loss_and_gradient() -> None:
    """Logits split over 2 real ranks by vocabulary (a column-parallel head that does not gather): every rank gets
    the whole-vocabulary loss, and the gradient of its own slice."""
    import shared_ranks

    for per_rank in shared_ranks.run(_vocab_parallel):
        for _name, full, part, grad_err in per_rank:
            assert part == pytest.approx(full, rel=1e-5)
            assert grad_err < 1e-6
