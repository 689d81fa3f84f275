"""The embedded corpus: generated English-like prose shipped in the package (see ``generate_corpus.py``)."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

import numpy as np


@lru_cache(maxsize=1)
def corpus_bytes() -> bytes:
    """The raw corpus (about 600 kB of ASCII text)."""
    return resources.files("crosstrain.data").joinpath("corpus.txt").read_bytes()


def corpus_tokens() -> np.ndarray:
    """The corpus as byte-level token ids (uint8)."""
    return np.frombuffer(corpus_bytes(), dtype=np.uint8)
