"""Fixed-length training samples cut from a flat token array (in memory or memory-mapped)."""

from __future__ import annotations

import numpy as np
import torch

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

    def batch(self, indices: np.ndarray | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, both int64 ``[len(indices), seq_len]``."""
        idx = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len + self._offsets
        rows = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        return rows[:, :-1], rows[:, 1:]


def build_dataset(path: str, seq_len: int) -> TokenDataset:
    """The embedded corpus when ``path`` is empty, else a memory-mapped token file."""
    if not path:
        from crosstrain.data.corpus import corpus_tokens

        return TokenDataset(corpus_tokens(), seq_len, 256)
    from crosstrain.data.tokenfile import open_token_file

    tokens, vocab = open_token_file(path)
    return TokenDataset(tokens, seq_len, vocab)
