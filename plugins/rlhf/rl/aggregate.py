"""How per-token losses become one loss: the aggregation modes, normalised by GLOBAL counts.

The loop averages each micro-batch's loss over ``grad_accum`` micro-batches and data-parallel ranks. A recipe
therefore returns ``aggregate(...) * terms`` with ``terms = grad_accum * dp`` and the token and sequence counts
of the whole optimizer step (all micro-batches, all ranks; :func:`crosstrain.collective.global_sums`): the mean
of those is the loss of the global batch, whatever the layout, instead of a mean of per-micro-batch means that
depends on it.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: Aggregation, *, tokens: float, sequences: float,
              max_tokens: int = 0) -> torch.Tensor:
    """This micro-batch's share of the global loss, from per-token ``loss [B, T]`` and ``mask [B, T]``
    (names as verl's ``loss_agg_mode``):

    - ``token-mean``: ``sum_{i,t} l_it / N_tokens`` (DAPO, Yu et al. 2025: every token weighs the same);
    - ``seq-mean-token-mean``: ``sum_i (sum_t l_it / |y_i|) / N_seqs`` (the original GRPO, Shao et al. 2024);
    - ``seq-mean-token-sum``: ``sum_{i,t} l_it / N_seqs``;
    - ``seq-mean-token-sum-norm``: ``sum_{i,t} l_it / (N_seqs * max_tokens)``: Dr. GRPO's constant normaliser
      (Liu et al. 2025), the generation budget instead of the sampled lengths, so no length bias.

    ``tokens`` and ``sequences`` are the counts of the global batch, not of this micro-batch.
    """
    m = mask.to(loss.dtype)
    masked = loss * m
    if mode == "token-mean":
        return masked.sum() / max(tokens, 1.0)
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / m.sum(-1).clamp(min=1)).sum() / max(sequences, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(sequences, 1.0)
    if mode == "seq-mean-token-sum-norm":
        if max_tokens < 1:
            raise ValueError("seq-mean-token-sum-norm needs max_tokens >= 1 (the generation budget)")
        return masked.sum() / (max(sequences, 1.0) * max_tokens)
    raise ValueError(f"mode={mode!r} is not one of token-mean, seq-mean-token-mean, seq-mean-token-sum, "
                     "seq-mean-token-sum-norm")
