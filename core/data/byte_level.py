"""crosstrain's byte tokenizer (token id == UTF-8 byte) written as a Hugging Face ``tokenizer.json``.

An exported byte-level model must come with a tokenizer that ``AutoTokenizer`` loads and that gives the same ids
as :class:`~crosstrain.data.tokenizer.ByteTokenizer`. That is a BPE model with no merges over the byte-level
alphabet: the ``ByteLevel`` pre-tokenizer maps each byte to one printable character (GPT-2's
``bytes_to_unicode``, openai/gpt-2 ``src/encoder.py``), and the vocabulary sends the character of byte ``b`` to
id ``b``. The ``ByteLevel`` decoder maps the characters back to bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.atomic import atomic_write


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> character table: printable Latin-1 bytes map to themselves, the other 68
    bytes to code points 256, 257, ... in byte order (so no byte maps to whitespace or a control character)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json() -> dict[str, Any]:
    """The ``tokenizer.json`` document of the byte tokenizer (vocabulary 256, no special tokens)."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def write_byte_tokenizer(folder: str | os.PathLike[str], model_max_length: int) -> list[Path]:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` of the byte tokenizer into ``folder``."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(root / "tokenizer.json", json.dumps(byte_tokenizer_json(), ensure_ascii=False))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "bos_token": None, "eos_token": None, "unk_token": None,
              "pad_token": None}
    atomic_write(root / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    return [root / "tokenizer.json", root / "tokenizer_config.json"]
