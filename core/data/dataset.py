"""Fixed-length training samples cut from a flat token array (in memory or memory-mapped)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from crosstrain.data.batch import TokenBatch
from crosstrain.errors import ConfigError


class TokenDataset:
    """Sample ``i`` is tokens ``[i*seq_len, (i+1)*seq_len]`` (inclusive, ``seq_len + 1`` ids): inputs + shift."""

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int = 256) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)
        if len(self) < 1:
            raise ConfigError(f"the data has {len(tokens)} tokens, too few for train.seq_len={seq_len}")

    def __len__(self) -> int:
        return max((len(self.tokens) - 1) // self.seq_len, 0)

    def batch(self, indices: np.ndarray | list[int]) -> TokenBatch:
        """``inputs`` and ``targets``, both int64 ``[len(indices), seq_len]``."""
        idx = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len + self._offsets
        rows = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        return TokenBatch(rows[:, :-1], rows[:, 1:])


def build_dataset(path: str, seq_len: int) -> TokenDataset:
    """The embedded corpus when ``path`` is empty, else a memory-mapped token file."""
    if not path:
        from crosstrain.data.corpus import corpus_tokens

        return TokenDataset(corpus_tokens(), seq_len, 256)
    from crosstrain.data.tokenfile import open_token_file

    tokens, vocab = open_token_file(path)
    return TokenDataset(tokens, seq_len, vocab)


def build_datasets(data_cfg: Any, seq_len: int) -> tuple[TokenDataset, TokenDataset | None, dict[str, Any]]:
    """Training and validation datasets from a ``[data]`` section, and the split record for the run dir.

    The validation part is ``data.val_path`` when set, else the last ``data.val_fraction`` of the data's tokens
    (see :mod:`crosstrain.data.split`); ``None`` when there is none.
    """
    from crosstrain.data.split import corpus_document_starts, split_tokens

    if not data_cfg.path:
        from crosstrain.data.corpus import corpus_bytes, corpus_tokens

        tokens, vocab, source = corpus_tokens(), 256, "embedded corpus"
        starts: np.ndarray | None = corpus_document_starts(corpus_bytes())
    else:
        from crosstrain.data.tokenfile import document_starts, open_token_file

        tokens, vocab = open_token_file(data_cfg.path)
        source, starts = str(data_cfg.path), document_starts(data_cfg.path, tokens)
    split = split_tokens(tokens, starts, 0.0 if data_cfg.val_path else float(data_cfg.val_fraction))
    info: dict[str, Any] = {"source": source, **split.info}
    train = TokenDataset(split.train, seq_len, vocab)
    val = None
    if data_cfg.val_path:
        from crosstrain.data.tokenfile import open_token_file

        val_tokens, val_vocab = open_token_file(data_cfg.val_path)
        if val_vocab > vocab:
            raise ConfigError(f"data.val_path {data_cfg.val_path!r} has vocabulary {val_vocab}, larger than the "
                              f"training data's {vocab}; prepare both with the same tokenizer")
        val = _val_dataset(val_tokens, seq_len, vocab, f"data.val_path {data_cfg.val_path!r}")
        info.update({"val_source": str(data_cfg.val_path), "val_tokens": int(len(val_tokens))})
    elif split.val is not None:
        val = _val_dataset(split.val, seq_len, vocab, f"the validation split of {source}", len(tokens))
    info["val_samples"] = len(val) if val is not None else 0
    return train, val, info


def _val_dataset(tokens: np.ndarray, seq_len: int, vocab: int, what: str, total: int = 0) -> TokenDataset:
    """``total``: the tokens the split was taken from (0: a separate file), to name the fraction that fits."""
    if (len(tokens) - 1) // seq_len < 1:
        need = (seq_len + 1) / total if total else 1.0
        if not total:
            fix = "give data.val_path a longer file"
        elif need > 0.5:  # holding out one sample would take most of the data
            fix = f"the data ({total} tokens) is too small to hold one out: set data.val_fraction=0 or data.val_path"
        else:
            fix = f"raise data.val_fraction to {math.ceil(1000 * need) / 1000:g}"
        raise ConfigError(f"{what} has {len(tokens)} tokens, too few for one sample of train.seq_len={seq_len}; "
                          f"{fix}, or lower train.seq_len")
    return TokenDataset(tokens, seq_len, vocab)
