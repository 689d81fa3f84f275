"""The RLHF losses as pure functions: per-sequence log-probs in, per-example losses (and rewards) out.

Every function but :func:`sft_token_loss` returns *per-example* values; the recipes average them over the examples
of a micro-batch, and since every micro-batch holds the same number of examples, the loop's mean over
micro-batches and data-parallel ranks is the global mean over examples (so grad_accum and the number of ranks do
not change the loss). :func:`sft_token_loss` divides by the step's global completion-token count instead.
Names and formulas follow TRL (``trl.DPOTrainer.dpo_loss``, ``trl.RewardTrainer.compute_loss``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

DPOLossType = Literal["sigmoid", "cdpo", "hinge", "ipo", "robust"]


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[..., labels]``: the log-probability of each label, ``[B, T]`` from ``[B, T, V]``."""
    logp = F.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    return logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence summed log-probs ``sum_t mask[b,t] * log p(labels[b,t])`` and lengths ``sum_t mask[b,t]``.

    ``logits [B, T, V]`` predict ``labels [B, T]`` (already shifted: position t predicts token t+1); ``mask``
    is 1 on completion tokens and 0 on prompt and padding.
    """
    lp = token_logps(logits, labels)
    m = mask.to(lp.dtype)
    return (lp * m).sum(-1), m.sum(-1)


def sft_loss(token_nll: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked negative log-likelihood per sequence: ``sum_t mask * nll / max(1, sum_t mask)``, shape ``[B]``
    (``rlhf.loss_normalization = "sequence"``).

    Prompt tokens (and padding) have ``mask`` 0, so only completions are learned. Each sequence weighs the same
    (the mean over its completion tokens), which keeps the mean over a batch independent of how the batch is cut
    into micro-batches. This is not TRL's SFTTrainer reduction: that is :func:`sft_token_loss`.
    """
    m = mask.to(token_nll.dtype)
    return (token_nll * m).sum(-1) / m.sum(-1).clamp(min=1)


def sft_token_loss(token_nll: torch.Tensor, mask: torch.Tensor, num_items: float | torch.Tensor) -> torch.Tensor:
    """``sum_{b,t} mask * nll / max(1, num_items)``, a scalar (``rlhf.loss_normalization = "token"``).

    TRL 1.16 ``SFTTrainer.compute_loss``: ``per_token_loss.sum() / num_items_in_batch``, where transformers'
    ``Trainer.get_batch_samples`` counts ``num_items_in_batch`` as the completion tokens of the whole gradient
    accumulation window, summed over ranks (``average_tokens_across_devices``). The caller passes that count (or,
    for one micro-batch alone, its own ``mask.sum()``), and scales by the number of micro-batches x ranks the loop
    averages over, as TRL multiplies by ``num_processes``.
    """
    m = mask.to(token_nll.dtype)
    return (token_nll * m).sum() / torch.as_tensor(num_items, dtype=token_nll.dtype).clamp(min=1)


def bradley_terry_loss(rewards_chosen: torch.Tensor, rewards_rejected: torch.Tensor, *,
                       margin: torch.Tensor | float = 0.0, center_coefficient: float = 0.0) -> torch.Tensor:
    """Reward-model loss per pair: ``-log sigmoid(r_c - r_r - margin) + c * (r_c + r_r)^2``.

    Bradley & Terry 1952; the pairwise ranking loss of Ouyang et al. 2022 (InstructGPT, arXiv:2203.02155); the
    ``margin`` of Touvron et al. 2023 (Llama 2, arXiv:2307.09288); ``c`` is TRL's ``center_rewards_coefficient``
    (Eisenstein et al. 2023, arXiv:2312.09244), whose mean over pairs is TRL's ``c * mean((r_c + r_r)^2)``.
    """
    loss = -F.logsigmoid(rewards_chosen - rewards_rejected - margin)
    if center_coefficient:
        loss = loss + center_coefficient * (rewards_chosen + rewards_rejected) ** 2
    return loss


def dpo_loss(
    policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor, reference_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor | None = None, rejected_lengths: torch.Tensor | None = None, *,
    beta: float = 0.1, loss_type: DPOLossType = "sigmoid", label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO-family loss per pair, and the implicit rewards ``beta * (log pi - log pi_ref)`` of chosen and rejected.

    Inputs are per-sequence *summed* completion log-probs ``[B]`` and the completion lengths ``[B]``. With
    ``h = (log pi_c - log pi_ref_c) - (log pi_r - log pi_ref_r)``:

    - ``sigmoid`` (Rafailov et al. 2023, arXiv:2305.18290): ``-log sigmoid(beta h)``. TRL 1.16's ``sigmoid``
      ignores ``label_smoothing``; here eps != 0 is refused (name ``cdpo`` or ``robust``) rather than ignored
    - ``cdpo`` (conservative DPO, Mitchell 2023, "A note on DPO with noisy preferences"), label noise eps:
      ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``
    - ``hinge`` (SLiC, Zhao et al. 2023, arXiv:2305.10425): ``relu(1 - beta h)``
    - ``ipo`` (Azar et al. 2023, arXiv:2310.12036): ``(h - 1/(2 beta))^2`` with per-token-averaged log-probs
      (each log-ratio divided by its length, as TRL's ``ipo``); needs the lengths
    - ``robust`` (Chowdhury et al. 2024, arXiv:2403.00409), label noise eps < 0.5:
      ``(-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h)) / (1 - 2 eps)`` (TRL's ``robust``)

    The rewards are ``beta x`` the *summed* log-ratios for every loss type, ``ipo`` included, as TRL 1.16's
    ``DPOTrainer`` logs ``rewards/chosen`` and ``rewards/rejected``.
    """
    pc, pr, rc, rr = policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    chosen_ratio, rejected_ratio = pc - rc, pr - rr
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("loss_type='ipo' averages log-probs per token: pass chosen_lengths and rejected_lengths")
        h = chosen_ratio / chosen_lengths.clamp(min=1) - rejected_ratio / rejected_lengths.clamp(min=1)
    else:
        h = chosen_ratio - rejected_ratio
    eps = label_smoothing
    if loss_type == "sigmoid":
        if eps:
            raise ValueError(f"loss_type='sigmoid' takes no label_smoothing (TRL's ignores it), got {eps}; use "
                             "loss_type='cdpo' or 'robust'")
        loss = -F.logsigmoid(beta * h)
    elif loss_type == "cdpo":
        loss = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "hinge":
        loss = torch.relu(1 - beta * h)
    elif loss_type == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        if not 0 <= eps < 0.5:
            raise ValueError(f"loss_type='robust' needs 0 <= label_smoothing < 0.5, got {eps}")
        loss = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; choose sigmoid, cdpo, hinge, ipo or robust")
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def preference_accuracy(rewards_chosen: torch.Tensor, rewards_rejected: torch.Tensor) -> torch.Tensor:
    """Per pair: 1 where the chosen reward is higher, 0.5 on a tie, 0 otherwise (so an untrained policy that
    equals its reference scores 0.5). TRL's ``rewards/accuracies`` counts ties as 0; see :func:`strict_accuracy`."""
    diff = rewards_chosen - rewards_rejected
    return (diff > 0).to(diff.dtype) + 0.5 * (diff == 0).to(diff.dtype)


def strict_accuracy(rewards_chosen: torch.Tensor, rewards_rejected: torch.Tensor) -> torch.Tensor:
    """TRL's ``rewards/accuracies``: ``(r_c > r_r)`` per pair."""
    return (rewards_chosen > rewards_rejected).to(rewards_chosen.dtype)
