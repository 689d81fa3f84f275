"""Token files: a 32-byte header followed by the token ids, read back through a memory map.

Header: magic ``CTTOKENS``, format version (u32), bytes per token (u32), token count (u64), vocabulary size
(u32), reserved (u32); little-endian. ``crosstrain data prepare`` writes them.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from crosstrain.checkpoint.atomic import atomic_path
from crosstrain.errors import ConfigError

MAGIC = b"CTTOKENS"
VERSION = 1
HEADER = struct.Struct("<8sIIQII")
_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def itemsize_for(vocab_size: int) -> int:
    return 1 if vocab_size <= 1 << 8 else 2 if vocab_size <= 1 << 16 else 4


def write_token_file(path: str | os.PathLike[str], chunks: Iterable[np.ndarray], vocab_size: int) -> int:
    """Stream token chunks into ``path`` atomically (a temp file renamed at the end); returns the count."""
    path = Path(path)
    itemsize = itemsize_for(vocab_size)
    dtype = _DTYPES[itemsize]
    count = 0
    with atomic_path(path) as tmp, tmp.open("wb") as fh:
        fh.write(HEADER.pack(MAGIC, VERSION, itemsize, 0, vocab_size, 0))
        for chunk in chunks:
            arr = np.asarray(chunk)
            if arr.size and int(arr.max()) >= vocab_size:
                raise ValueError(f"token id {int(arr.max())} >= vocab_size {vocab_size}")
            fh.write(arr.astype(dtype, copy=False).tobytes())
            count += int(arr.size)
        fh.seek(0)
        fh.write(HEADER.pack(MAGIC, VERSION, itemsize, count, vocab_size, 0))
    return count


def read_header(path: str | os.PathLike[str]) -> tuple[int, int, int]:
    """``(itemsize, num_tokens, vocab_size)`` of a token file; a bad file is a ConfigError naming it."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(HEADER.size)
    except OSError as exc:  # missing, a folder, unreadable
        raise ConfigError(f"token file {str(path)!r} cannot be read ({exc.strerror}); write one with "
                          "'crosstrain data prepare FILES --out data.bin'") from None
    if len(raw) < HEADER.size:
        raise ConfigError(f"data.path {str(path)!r} is not a crosstrain token file (too short)")
    magic, version, itemsize, count, vocab, _ = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION or itemsize not in _DTYPES:
        raise ConfigError(f"data.path {str(path)!r} is not a crosstrain token file; write one with "
                          "'crosstrain data prepare FILES --out data.bin'")
    size = os.path.getsize(path)
    if size != HEADER.size + count * itemsize:
        raise ConfigError(f"data.path {str(path)!r} is truncated ({size} bytes, header says {count} tokens)")
    return itemsize, count, vocab


def open_token_file(path: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
    """A read-only memory map of the tokens and the vocabulary size."""
    itemsize, count, vocab = read_header(path)
    tokens = np.memmap(path, dtype=_DTYPES[itemsize], mode="r", offset=HEADER.size, shape=(count,))
    return tokens, vocab


def document_starts(path: str | os.PathLike[str], tokens: np.ndarray) -> np.ndarray | None:
    """Token offsets where the file's documents start, or None when the file records no boundaries (the
    manifest ``crosstrain data prepare`` writes next to it: :mod:`crosstrain.data.manifest`)."""
    from crosstrain.data.manifest import document_starts as from_manifest

    return from_manifest(path, len(tokens))
