"""Load-balancing terms: the Switch auxiliary loss (four scopes), the router z-loss, the aux-loss-free bias
update, and the router entropy. Each is one pure function of the router's outputs."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def expert_counts(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """How many of the ``ids`` (any shape, values in ``[0, experts)``) chose each expert, as fp32 ``[experts]``."""
    return torch.bincount(ids.reshape(-1), minlength=experts).float()


def switch_aux_loss(probs: torch.Tensor, ids: torch.Tensor, coeff: float,
                    counts: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer load-balancing loss ``coeff * E * sum_i f_i * P_i`` (Fedus et al. 2021, eq. 4-6).

    ``probs [N, E]`` is the routing distribution, ``ids [N, k]`` the chosen experts; ``f_i`` is the fraction
    of the ``N * k`` choices that went to expert ``i`` (not differentiable), ``P_i = mean_n probs[n, i]``.
    ``counts`` (the choices per expert) replaces the local ones, e.g. counts summed over the global batch.
    Uniform routing gives exactly ``coeff``.
    """
    experts = probs.shape[-1]
    counts = expert_counts(ids, experts) if counts is None else counts.float()
    f = counts / counts.sum().clamp_min(1.0)
    return coeff * experts * (f.detach() * probs.float().mean(dim=0)).sum()


def sequence_aux_loss(probs: torch.Tensor, ids: torch.Tensor, coeff: float) -> torch.Tensor:
    """The Switch loss per sequence, averaged over sequences (DeepSeek-V3's sequence-wise balance loss,
    eq. 17-20): ``coeff * E * mean_b sum_i f_{b,i} * P_{b,i}`` with ``probs [B, T, E]``, ``ids [B, T, k]``."""
    experts = probs.shape[-1]
    b, _, k = ids.shape
    onehot = torch.zeros(b, experts, device=ids.device).scatter_add_(
        1, ids.reshape(b, -1), torch.ones(ids.reshape(b, -1).shape, device=ids.device))
    f = onehot / (ids.shape[1] * k)
    return coeff * experts * (f.detach() * probs.float().mean(dim=1)).sum(dim=-1).mean()


def global_counts(ids: torch.Tensor, experts: int, group: Any = None) -> torch.Tensor:
    """Choices per expert summed over the ranks of ``group`` (one all-reduce; local counts without a group).

    The global-batch Switch loss (Qiu et al. 2025, "Demons in the detail") uses them as ``f_i``, and only
    them: with ``f`` global and ``P`` this rank's mean, rank ``r`` computes ``c E sum_i f_i P_i^r``. The loop
    averages losses and gradients over the data-parallel ranks, and the loss is linear in ``P`` with ``f``
    constant (not differentiated, Fedus et al. 2021 eq. 4-6), so the mean of the ranks' values is
    ``c E sum_i f_i mean_r P_i^r`` -- the one-process loss of the whole micro-batch -- and so is the mean of
    their gradients. All-reducing ``P`` too would count its gradient once per rank. Ranks holding the same
    tokens (tp peers) scale every count alike, which leaves the fractions ``f`` unchanged.
    """
    counts = expert_counts(ids, experts)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return counts


def pooled_stats(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One layer's share of :func:`pooled_aux_loss`: ``[c_i, sum_n probs[n, i], N]`` as fp32 ``[2E + 1]``, with
    ``c_i`` the top-k choices of expert ``i`` (not differentiable) for ``probs [N, E]`` and ``ids [N, k]``."""
    counts = expert_counts(ids.detach(), probs.shape[-1]).to(probs.device)
    return torch.cat([counts, probs.float().sum(dim=0), counts.new_tensor([float(probs.shape[0])])])


def pooled_aux_loss(stats: torch.Tensor, coeff: float, group: Any = None) -> torch.Tensor:
    """transformers' MoE balance loss (``load_balancing_loss_func`` of Mixtral and Qwen3-MoE): the Switch loss
    (Fedus et al. 2021, eq. 4-6) with both factors pooled over every MoE layer of the forward,
    ``coeff * E * sum_i F_i * P_i``, ``F_i = sum_l c_{l,i} / sum_l N_l`` (so ``sum_i F_i = k``) and
    ``P_i = sum_l sum_n p_{l,n,i} / sum_l N_l``, from the summed :func:`pooled_stats`. Uniform routing gives
    ``coeff * k``.

    The counts and token numbers are summed over the ranks of ``group`` (one all-reduce per forward); ``P`` stays
    this rank's. With ``F`` constant the loss is linear in ``P``, so the ranks' mean is the one-process loss of the
    whole batch, as for :func:`global_counts`.
    """
    experts = (stats.numel() - 1) // 2
    counts = torch.cat([stats[:experts], stats[-1:]]).detach().clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    f = counts[:experts] / counts[-1].clamp_min(1.0)
    p = stats[experts:-1] / stats[-1].clamp_min(1.0)
    return coeff * experts * (f * p).sum()


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """Router z-loss ``coeff * mean_n logsumexp(logits_n)^2`` (Zoph et al. 2022, ST-MoE, eq. 5), in fp32."""
    return coeff * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def bias_update(bias: torch.Tensor, loads: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing: ``b_i + rate * sign(mean(load) - load_i)`` (Wang et al. 2024, "Auxiliary-loss-free
    load balancing", alg. 1; DeepSeek-V3 2.1.2): overloaded experts become less likely to be chosen."""
    loads = loads.float()
    return bias + rate * torch.sign(loads.mean() - loads).to(bias.dtype)


def router_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Mean entropy ``-sum_i p_i log p_i`` of the routing distributions ``probs [..., E]`` (nats)."""
    p = probs.float()
    return -(p * torch.log(p.clamp_min(1e-20))).sum(dim=-1).mean()
