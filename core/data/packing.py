"""``data.packing = "documents"``: training rows that carry the document id of every input token.

Rows are the same windows as without packing (documents concatenated, separators kept); the GPT turns the ids
into block-causal attention and per-document positions (:mod:`crosstrain.models.document_mask`), so no token
attends across a document boundary. Boundaries come from the token file's manifest (``crosstrain data
prepare``) or, for the embedded corpus, its chapters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from crosstrain.data.batch import TokenBatch
from crosstrain.data.dataset import TokenDataset
from crosstrain.errors import ConfigError
from crosstrain.models.document_mask import document_positions


class PackedDataset:
    """A :class:`TokenDataset` whose batches also carry ``document_ids`` (int64 ``[B, T]``, the documents inside
    each row numbered from 0) and each token's ``positions`` inside its document (:class:`TokenBatch`)."""

    def __init__(self, base: TokenDataset, doc_starts: np.ndarray) -> None:
        self.base = base
        self.doc_starts = np.asarray(doc_starts, dtype=np.int64)
        self.seq_len = base.seq_len
        self.vocab_size = base.vocab_size
        self.tokens = base.tokens
        self._offsets = np.arange(base.seq_len, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.base)

    def batch(self, indices: Any) -> TokenBatch:
        rows = self.base.batch(indices)
        offsets = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len + self._offsets
        doc = np.searchsorted(self.doc_starts, offsets, side="right") - 1
        doc_ids = torch.from_numpy(doc - doc[:, :1])
        return TokenBatch(rows.inputs, rows.targets, doc_ids, document_positions(doc_ids))


def _starts(data_cfg: Any) -> np.ndarray | None:
    if not data_cfg.path:
        from crosstrain.data.corpus import corpus_bytes
        from crosstrain.data.split import corpus_document_starts

        return corpus_document_starts(corpus_bytes())
    from crosstrain.data.manifest import document_starts
    from crosstrain.data.tokenfile import read_header

    return document_starts(data_cfg.path, read_header(data_cfg.path)[1])


def pack_datasets(
    data_cfg: Any, train: TokenDataset, val: TokenDataset | None, split: dict[str, Any],
) -> tuple[PackedDataset, PackedDataset | None]:
    """Wrap the training (and validation) datasets of ``build_datasets``; ``split`` is its record (a held-out
    split starts at token ``split_at_token``)."""
    starts = _starts(data_cfg)
    if starts is None:
        raise ConfigError(f"data.packing='documents' needs document boundaries, but data.path {data_cfg.path!r} has "
                          "no manifest; prepare it with 'crosstrain data prepare' or set data.packing='concat'")
    cut = int(split.get("split_at_token", len(train.tokens)))
    packed_val = None
    if val is not None:
        if data_cfg.val_path:
            from crosstrain.data.manifest import document_starts

            val_starts = document_starts(data_cfg.val_path, len(val.tokens))
            if val_starts is None:
                raise ConfigError(f"data.packing='documents' needs document boundaries, but data.val_path "
                                  f"{data_cfg.val_path!r} has no manifest; prepare it with 'crosstrain data prepare'")
        else:
            val_starts = np.concatenate([[0], starts[starts > cut] - cut])
        packed_val = PackedDataset(val, val_starts)
    return PackedDataset(train, starts[starts < cut]), packed_val
