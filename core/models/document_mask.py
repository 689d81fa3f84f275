"""Document-aware attention for packed sequences: per-document positions and block-causal masks.

When several documents are packed into one training row, each token should attend only to earlier tokens of
its own document and see rotary positions that restart at 0 where its document starts, so a packed document
gets exactly the logits it would get alone (the "document masking" of Llama 3 pretraining and torchtitan's
FlexAttention block-causal masks). ``doc_ids`` ``[B, T]`` labels each token's document; only *changes* of
label matter, so any labelling of contiguous runs works.
"""

from __future__ import annotations

import torch


def segment_index(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` running index of the contiguous run of equal ``doc_ids`` each token is in (0, 1, 2, ...)."""
    change = torch.zeros_like(doc_ids, dtype=torch.long)
    change[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).long()
    return change.cumsum(dim=1)


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` position of each token inside its document: ``t - start(doc(t))``."""
    t = doc_ids.shape[1]
    idx = torch.arange(t, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.zeros_like(doc_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_idx


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T, T]`` boolean mask, True where query ``i`` may attend key ``j``: ``j <= i`` and same document. The
    dense reference; the GPT attends through :mod:`crosstrain.models.attention_masks`, which never builds it.

    Every row keeps its diagonal, so no softmax row is empty (SDPA's boolean ``attn_mask`` convention).
    """
    seg = segment_index(doc_ids)
    t = doc_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    return (seg.unsqueeze(2) == seg.unsqueeze(1)) & causal
