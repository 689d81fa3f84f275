"""Whether a causal LM sees the future: the logits of a prefix must not move when the tokens after it change."""

from __future__ import annotations

from collections.abc import Callable

import torch


def prefix_moves(logits: Callable[[torch.Tensor], torch.Tensor], vocab: int = 256) -> float:
    """How far the logits of the first 8 positions move when the last 4 of 12 tokens change (0.0 when causal)."""
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % vocab
    with torch.no_grad():
        return float((logits(ids)[:, :8] - logits(changed)[:, :8]).abs().max())
