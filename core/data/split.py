"""The held-out validation split: whole documents taken from the end of the data, never a document cut in two.

The last ``ceil(val_fraction * documents)`` documents (at least one, and at least one left for training) form
the validation part; everything before them is the training part. Both are views of the same token array (no
copy, also for memory-mapped files), and the split depends only on the data and the fraction, so it is the
same on every rank and in every run. A separate ``data.val_path`` replaces the held-out part.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from crosstrain.errors import ConfigError


@dataclass
class Split:
    """Training and validation tokens, and what the run dir records about how they were split."""

    train: np.ndarray
    val: np.ndarray | None
    info: dict[str, Any] = field(default_factory=dict)


def split_documents(tokens: np.ndarray, doc_starts: np.ndarray | None, val_fraction: float) -> Split:
    """Split ``tokens`` whose documents start at ``doc_starts`` (sorted token offsets, the first 0)."""
    total = int(len(tokens))
    if val_fraction <= 0:
        return Split(tokens, None, {"val_fraction": 0.0, "train_tokens": total, "val_tokens": 0})
    if doc_starts is None or len(doc_starts) < 2:
        found = 0 if doc_starts is None else len(doc_starts)
        raise ConfigError(f"data.val_fraction={val_fraction} needs at least 2 documents, but {found} document "
                          "boundaries are known for this data; set data.val_path to a separate token file or "
                          "data.val_fraction=0")
    docs = len(doc_starts)
    n_val = min(max(1, math.ceil(val_fraction * docs)), docs - 1)
    cut = int(doc_starts[docs - n_val])
    info = {"val_fraction": val_fraction, "documents": docs, "val_documents": n_val, "split_at_token": cut,
            "train_tokens": cut, "val_tokens": total - cut}
    return Split(tokens[:cut], tokens[cut:], info)


_CHAPTER = re.compile(rb"(?m)^Chapter \d+: ")


def corpus_document_starts(text: bytes) -> np.ndarray:
    """Byte offsets of the embedded corpus's documents (its chapters), which are also its token offsets."""
    return np.asarray([m.start() for m in _CHAPTER.finditer(text)], dtype=np.int64)


def separator_document_starts(tokens: np.ndarray, separator: int) -> np.ndarray:
    """Document starts of a token stream whose documents are separated by the token ``separator`` (EOS)."""
    ends = np.flatnonzero(np.asarray(tokens) == separator)
    starts = np.concatenate([[0], ends + 1]).astype(np.int64)
    return starts[starts < len(tokens)]
