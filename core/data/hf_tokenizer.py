"""Tokenizers from a folder with a Hugging Face ``tokenizer.json`` (``data.tokenizer = DIR``), next to the default
byte tokenizer. Needs the ``tokenizers`` package (the ``hf`` extra) only when such a folder is used.

A tokenizer is identified by the SHA-256 of its ``tokenizer.json`` bytes: token files record it in their manifest
and training refuses data prepared with another tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from crosstrain.data.tokenizer import ByteTokenizer
from crosstrain.errors import ConfigError

#: files a tokenizer folder may hold that transformers' AutoTokenizer reads: the tokenizer, its special tokens and
#: its chat template (transformers 5 saves it as ``chat_template.jinja``; multimodal processors as ``.json``).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


def _tokenizer_json(folder: str | os.PathLike[str]) -> Path:
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"tokenizer {str(folder)!r} has no tokenizer.json; train one with 'crosstrain tokenizer "
                          "train' or point data.tokenizer at a Hugging Face tokenizer folder")
    return path


@lru_cache(maxsize=16)
def _describe(path: str, mtime_ns: int) -> dict[str, Any]:
    raw = Path(path).read_bytes()
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from None
    try:
        vocab = doc["model"]["vocab"]
        # BPE/WordPiece map token -> id; Unigram lists [piece, score] pairs in id order
        ids = list(range(len(vocab))) if isinstance(vocab, list) else [int(v) for v in vocab.values()]
        ids += [int(t["id"]) for t in doc.get("added_tokens", [])]
    except (AttributeError, KeyError, TypeError, ValueError):
        ids = []
    if not ids:
        raise ConfigError(f"{path} is not a Hugging Face tokenizer.json (it needs a model.vocab of token ids); "
                          "train one with 'crosstrain tokenizer train' or use a Hugging Face tokenizer folder")
    folder = Path(path).parent
    eos = _special(folder, "eos_token")
    eos_id = next((int(t["id"]) for t in doc.get("added_tokens", []) if t.get("content") == eos), None)
    return {"type": "hf", "path": str(folder.resolve()), "sha256": hashlib.sha256(raw).hexdigest(),
            "vocab_size": max(ids) + 1, "eos_id": eos_id,
            "eos_token": eos if eos_id is not None else None}


def _special(folder: Path, key: str) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.is_file():
            value = json.loads(path.read_text()).get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if value:
                return str(value)
    return None


def special_token_id(folder: str | os.PathLike[str], key: str) -> int | None:
    """The id of the tokenizer's ``key`` token (``bos_token``, ``eos_token``, ``pad_token``) in ``folder``'s
    tokenizer.json (added tokens, then the model's vocabulary); None when it declares none."""
    token = _special(Path(folder), key)
    if token is None:
        return None
    doc = json.loads(_tokenizer_json(folder).read_text())
    found = next((int(t["id"]) for t in doc.get("added_tokens", []) if t.get("content") == token), None)
    vocab = (doc.get("model") or {}).get("vocab")
    if found is None and isinstance(vocab, dict) and token in vocab:
        found = int(vocab[token])
    return found


def describe_tokenizer(spec: str) -> dict[str, Any]:
    """Metadata of a tokenizer spec ("" / "byte" or a folder) without loading it: type, path, sha256, vocab_size,
    eos_id. Cheap (cached per file version), so config checks may call it often."""
    if spec in ("", "byte"):
        return {"type": "byte", "vocab_size": 256, "encoding": "utf-8", "bos_id": None, "eos_id": None}
    path = _tokenizer_json(spec)
    return dict(_describe(str(path), path.stat().st_mtime_ns))


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` from ``DIR/tokenizer.json``; ids as numpy arrays; no special tokens added."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("a tokenizer folder needs the 'tokenizers' package; "
                              "pip install 'crosstrain[hf]'") from None
        self.info = describe_tokenizer(str(folder))
        self.path = Path(self.info["path"])
        try:
            self.tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ConfigError(f"{self.path / 'tokenizer.json'} cannot be loaded by tokenizers ({exc}); train one with "
                              "'crosstrain tokenizer train' or use a Hugging Face tokenizer folder") from None
        self.vocab_size = int(self.info["vocab_size"])
        self.eos_id: int | None = self.info["eos_id"]
        self.eos_token: str | None = self.info["eos_token"]
        self.name = f"{self.path.name} ({self.info['sha256'][:12]})"

    def _text(self, text: str | bytes) -> str:
        return text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text

    def encode(self, text: str | bytes) -> np.ndarray:
        ids = self.tokenizer.encode(self._text(text), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.uint32)

    def encode_offsets(self, text: str, add_special_tokens: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Ids of ``text`` and each token's ``[start, end)`` character range; ``add_special_tokens`` applies the
        tokenizer's post-processor (BOS/EOS as its ``tokenizer.json`` adds them; added tokens get empty ranges)."""
        enc = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(enc.ids, dtype=np.uint32), offsets

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets nobody here reads: ~1.8x faster
        fast = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    def decode(self, ids: object) -> str:
        return self.tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """The byte tokenizer for ``""``/``"byte"``, else the folder's tokenizer.json."""
    return ByteTokenizer() if spec in ("", "byte") else HFTokenizer(spec)
