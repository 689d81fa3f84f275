"""The held-out validation split: the last ``val_fraction`` of the data's tokens, cut at a document boundary
when one lies close enough, else inside a document at a token boundary.

The validation part holds ``ceil(val_fraction * tokens)`` tokens (at least one, and at least one left for
training), so the share holds by tokens whatever the documents' sizes: two input files (two long documents)
no longer put half of the data in validation. When a document boundary lies within ``SNAP`` (10%) of that
target, the cut moves to it and no document is split; otherwise the cut falls inside the one document that
straddles it: its head trains, its tail validates (the tail is a document of its own for
``data.packing="documents"``), and no token is in both parts. The split depends only on the data and the
fraction, so it is the same on every rank and in every run. Both parts are views of the same token array (no
copy, also for memory-mapped files). A separate ``data.val_path`` replaces the held-out part.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: A document boundary within this share of the validation target moves the cut to it (no document split).
SNAP = 0.1


@dataclass
class Split:
    """Training and validation tokens, and what the run dir records about how they were split."""

    train: np.ndarray
    val: np.ndarray | None
    info: dict[str, Any] = field(default_factory=dict)


def split_tokens(tokens: np.ndarray, doc_starts: np.ndarray | None, val_fraction: float) -> Split:
    """Split ``tokens`` (documents start at ``doc_starts``: sorted token offsets, the first 0; None when unknown)
    so the last ``val_fraction`` of the tokens validate."""
    total = int(len(tokens))
    if val_fraction <= 0 or total < 2:
        return Split(tokens, None, {"val_fraction": 0.0, "train_tokens": total, "val_tokens": 0})
    target = min(max(1, math.ceil(val_fraction * total)), total - 1)
    cut = total - target
    starts = np.asarray([] if doc_starts is None else doc_starts, dtype=np.int64)
    inner = starts[(starts > 0) & (starts < total)]
    if len(inner):
        nearest = int(inner[np.argmin(np.abs(inner - cut))])
        if abs(nearest - cut) <= SNAP * target:
            cut = nearest
    info: dict[str, Any] = {"val_fraction": val_fraction, "split_at_token": cut, "train_tokens": cut,
                            "val_tokens": total - cut}
    if doc_starts is not None:
        # the document holding token ``cut``: split unless it starts there
        cut_doc = int(np.searchsorted(starts, cut, side="right")) - 1
        info.update({"documents": len(starts), "val_documents": len(starts) - cut_doc,
                     "document_split": bool(starts[cut_doc] != cut)})
    return Split(tokens[:cut], tokens[cut:], info)


def split_line(info: dict[str, Any]) -> str:
    """The one line the run prints about its split, e.g. ``data: 95,000 train / 5,000 val tokens (5.0%)``."""
    train, val = int(info.get("train_tokens", 0)), int(info.get("val_tokens", 0))
    if "val_source" in info:
        return f"data: {train:,} train tokens / {val:,} val tokens from data.val_path"
    if not val:
        return f"data: {train:,} train tokens, no validation split (data.val_fraction=0)"
    where = ", a document split at the cut" if info.get("document_split") else ""
    return f"data: {train:,} train / {val:,} val tokens ({100 * val / (train + val):.1f}% held out{where})"


_CHAPTER = re.compile(rb"(?m)^Chapter \d+: ")


def corpus_document_starts(text: bytes) -> np.ndarray:
    """Byte offsets of the embedded corpus's documents (its chapters), which are also its token offsets."""
    return np.asarray([m.start() for m in _CHAPTER.finditer(text)], dtype=np.int64)


def separator_document_starts(tokens: np.ndarray, separator: int) -> np.ndarray:
    """Document starts of a token stream whose documents are separated by the token ``separator`` (EOS)."""
    ends = np.flatnonzero(np.asarray(tokens) == separator)
    starts = np.concatenate([[0], ends + 1]).astype(np.int64)
    return starts[starts < len(tokens)]
