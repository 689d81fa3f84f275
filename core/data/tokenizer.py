"""Byte-level tokenizer: token ids are the UTF-8 bytes (vocabulary 256), so nothing is downloaded."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Encodes text as its UTF-8 bytes; decoding replaces invalid sequences."""

    vocab_size = 256
    name = "byte"

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).copy()

    def encode_offsets(self, text: str, add_special_tokens: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``encode(text)`` and each token's ``[start, end)`` character range in ``text`` (a byte's character);
        there are no special tokens to add."""
        sizes = np.asarray([len(ch.encode("utf-8")) for ch in text], dtype=np.int64)
        start = np.repeat(np.arange(len(text), dtype=np.int64), sizes)
        return self.encode(text), np.stack([start, start + 1], axis=1).reshape(-1, 2)

    def decode(self, ids: object) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError("byte tokenizer ids must be in [0, 255]")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
