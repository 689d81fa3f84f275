"""Distillation divergences: pure functions of log-probabilities, and the chunked per-token driver the recipe uses.

Each divergence takes the teacher's and the student's log-probabilities over the same outcomes (the last dimension:
the vocabulary, or the teacher's top-k tokens plus one tail bucket) and returns one value per token.

Memory: :func:`distill_loss` walks the ``[B, T, V]`` logits ``chunk_tokens`` rows at a time; each chunk is upcast to
fp32 and its divergence recomputed in the backward (activation checkpointing), so besides the models' own outputs
at most one chunk of fp32 ``[chunk, V]`` intermediates is alive, not the several full ``[B, T, V]`` fp32 tensors
(log-softmax of both, probabilities, mixture) that the one-shot formula keeps for its backward (NeMo's KDLoss and
Liger's chunked distillation losses make the same trade).

Vocabulary-parallel logits: with ``group``, each rank holds its slice ``[..., V / n]`` of the vocabulary (a
column-parallel output layer that does not gather), and :func:`distill_loss` computes the log-softmax and every
per-token sum across the group (NeMo's and Megatron-LM's vocabulary-parallel cross-entropy), so each rank gets the
full divergence and the gradient of its own slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from crosstrain.parallel.tp_autograd import all_reduce_sum, reduce_from_tp

LossName = Literal["forward_kl", "reverse_kl", "jsd"]
#: the log of fp32's smallest normal number: a tail bucket with no mass left is floored here, so every
#: divergence stays finite (an exact 0 would make the reverse KL infinite and its gradient NaN)
LOG_TINY = math.log(torch.finfo(torch.float32).tiny)


def _vocab_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x.sum(-1)`` over the whole vocabulary: the local slice's, summed over the group when it is split."""
    local = x.sum(-1)
    return local if group is None else reduce_from_tp(local, group)


def log_softmax(logits: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``log_softmax`` over the last dimension; with ``group``, a vocabulary split over its ranks (the max is taken
    without gradient: the result does not depend on it)."""
    if group is None:
        return F.log_softmax(logits, -1)
    peak = logits.detach().amax(-1, keepdim=True)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    total = all_reduce_sum((logits - peak).exp().sum(-1, keepdim=True), group)
    return logits - peak - total.log()


def kl(p_logp: torch.Tensor, q_logp: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``KL(p || q) = sum_v p_v (log p_v - log q_v)`` over the last dimension (Kullback & Leibler 1951)."""
    return _vocab_sum(p_logp.exp() * (p_logp - q_logp), group)


def forward_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``KL(teacher || student)``: the mode-covering KD loss of Hinton et al. 2015 (up to the teacher's entropy, which
    has no gradient: torchtune's ``ForwardKLLoss`` computes ``-sum_v p_T log q_S``, the same gradient)."""
    return kl(teacher_logp, student_logp, group)


def reverse_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``KL(student || teacher)``: mode-seeking (MiniLLM, Gu et al. 2024); TRL's GKD ``beta = 1``."""
    return kl(student_logp, teacher_logp, group)


def generalized_jsd(teacher_logp: torch.Tensor, student_logp: torch.Tensor, beta: float,
                    group: Any = None) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence of Agarwal et al. 2024 (GKD), as TRL's ``generalized_jsd_loss``:
    ``beta KL(p_T || m) + (1 - beta) KL(q_S || m)`` with the mixture ``m = beta p_T + (1 - beta) q_S``; at the ends,
    as TRL, ``beta = 0`` is the forward KL and ``beta = 1`` the reverse KL (the limits of JSD(beta)/beta and
    JSD(beta)/(1-beta))."""
    if beta <= 0.0:
        return forward_kl(teacher_logp, student_logp, group)
    if beta >= 1.0:
        return reverse_kl(teacher_logp, student_logp, group)
    mixture = torch.logsumexp(torch.stack([teacher_logp + math.log(beta), student_logp + math.log(1.0 - beta)]), 0)
    return beta * kl(teacher_logp, mixture, group) + (1.0 - beta) * kl(student_logp, mixture, group)


def divergence(name: LossName, teacher_logp: torch.Tensor, student_logp: torch.Tensor,
               beta: float = 0.5, group: Any = None) -> torch.Tensor:
    """The divergence ``[distill] loss`` names, per token (``group``: the vocabulary is split over its ranks)."""
    if name == "forward_kl":
        return forward_kl(teacher_logp, student_logp, group)
    if name == "reverse_kl":
        return reverse_kl(teacher_logp, student_logp, group)
    return generalized_jsd(teacher_logp, student_logp, beta, group)


@dataclass
class TopK:
    """A teacher's ``k`` most likely tokens per position: ``ids [..., k]`` and their log-probabilities under the full
    softmax (at the temperature the teacher was read at) ``logps [..., k]``."""

    ids: torch.Tensor
    logps: torch.Tensor


def with_tail(logp_topk: torch.Tensor) -> torch.Tensor:
    """``[..., k] -> [..., k + 1]``: the k log-probs and ``log(1 - sum_k p)``, the mass of every other token (floored
    at ``LOG_TINY``). The k tokens plus the tail is a coarsening of the vocabulary, so a divergence over it is a lower
    bound of the full one (data-processing inequality) and equals it when the tail is empty (k = V)."""
    rest = (-torch.logsumexp(logp_topk, -1, keepdim=True).exp()).log1p().nan_to_num(LOG_TINY)
    return torch.cat([logp_topk, rest.clamp_min(LOG_TINY)], -1)


def student_on_topk(student_logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The student's ``[..., V]`` log-probs coarsened like :func:`with_tail`: at the teacher's ``ids [..., k]``, plus
    the log-sum of every other token (computed from the other logits, not as ``1 - sum``, for its gradient)."""
    others = student_logp.scatter(-1, ids, float("-inf"))
    rest = torch.logsumexp(others, -1, keepdim=True).clamp_min(LOG_TINY)
    return torch.cat([student_logp.gather(-1, ids), rest], -1)


def teacher_topk(teacher_logits: torch.Tensor, k: int, temperature: float = 1.0) -> TopK:
    """The top ``k`` of ``log_softmax(teacher_logits / temperature)`` (what ``crosstrain distill cache`` stores)."""
    logp = F.log_softmax(teacher_logits.float() / temperature, -1)
    values, ids = logp.topk(k, -1)
    return TopK(ids, values)


def token_divergence(student_logits: torch.Tensor, teacher: torch.Tensor | TopK, *, loss: LossName = "forward_kl",
                     beta: float = 0.5, temperature: float = 1.0, top_k: int = 0, group: Any = None) -> torch.Tensor:
    """Per-token divergence ``[N]`` of ``student_logits [N, V]`` from the teacher's logits ``[N, V]`` or its
    :class:`TopK`, both softened by ``temperature`` (Hinton et al. 2015; the T^2 factor is :func:`distill_loss`'s).
    With ``top_k > 0`` or a :class:`TopK` teacher the divergence is over the teacher's top-k tokens plus the tail.
    ``group``: both logits hold this rank's slice of a vocabulary split over the group (full-vocabulary only)."""
    if group is not None and (top_k or isinstance(teacher, TopK)):
        raise ValueError("the top-k divergence needs whole vocabulary rows; gather the logits or set top_k=0")
    student_logp = log_softmax(student_logits.float() / temperature, group)
    if isinstance(teacher, torch.Tensor) and not top_k:
        return divergence(loss, log_softmax(teacher.float() / temperature, group), student_logp, beta, group)
    top = teacher if isinstance(teacher, TopK) else teacher_topk(teacher, top_k, temperature)
    return divergence(loss, with_tail(top.logps.float()), student_on_topk(student_logp, top.ids), beta)


def distill_loss(student_logits: torch.Tensor, teacher: torch.Tensor | TopK, mask: torch.Tensor, *,
                 loss: LossName = "forward_kl", beta: float = 0.5, temperature: float = 1.0, top_k: int = 0,
                 chunk_tokens: int = 1024, group: Any = None) -> torch.Tensor:
    """``T^2 * mean over tokens with mask of token_divergence`` for ``student_logits [B, T, V]`` (the T^2 keeps the
    gradient's scale independent of T: Hinton et al. 2015, section 2), ``chunk_tokens`` rows at a time (module
    docstring). ``mask [B, T]``: the tokens that count (all of plain text, the completion of a prompt/completion
    row). Rows of a chunk with no token to count are skipped. ``group``: vocabulary-parallel logits (module
    docstring); the mask is the same on every rank of the group."""
    vocab = student_logits.shape[-1]
    flat = student_logits.reshape(-1, vocab)
    weights = mask.reshape(-1).to(torch.float32)
    if isinstance(teacher, TopK):
        k = teacher.ids.shape[-1]
        parts: tuple[torch.Tensor, ...] = (teacher.ids.reshape(-1, k), teacher.logps.reshape(-1, k))
    else:
        parts = (teacher.reshape(-1, vocab),)

    def chunk_sum(s: torch.Tensor, w: torch.Tensor, *t: torch.Tensor) -> torch.Tensor:
        target = TopK(t[0], t[1]) if len(t) == 2 else t[0]
        per_token = token_divergence(s, target, loss=loss, beta=beta, temperature=temperature, top_k=top_k,
                                     group=group)
        return (per_token * w).sum()

    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        w = weights[rows]
        if not bool(w.any()):
            continue
        args = (flat[rows], w, *(p[rows] for p in parts))
        if torch.is_grad_enabled() and flat.requires_grad:
            total = total + checkpoint(chunk_sum, *args, use_reentrant=False)
        else:
            total = total + chunk_sum(*args)
    return total * temperature**2 / weights.sum().clamp_min(1.0)


def masked_nll(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of ``logits [B, T, V]`` over the tokens with ``mask`` (the kernel registry's)."""
    from crosstrain import kernels

    labels = targets.masked_fill(~mask.bool(), -100)
    return kernels.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
