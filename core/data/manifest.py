"""The manifest next to a prepared token file: tokenizer identity, document count and document boundaries.

``data.bin`` gets ``data.bin.manifest.json`` (tokenizer type, path, SHA-256 of its tokenizer.json and vocabulary;
token and document counts; per-input counts) and ``data.bin.docs.npy`` (int64 token offsets where documents
start, read with ``allow_pickle=False``). A manifest whose token count disagrees with the token file is stale and
ignored, so re-preparing a file without a manifest never leaves wrong boundaries behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from crosstrain.checkpoint.atomic import atomic_path, atomic_write
from crosstrain.errors import ConfigError

FORMAT = "crosstrain-token-manifest"
VERSION = 1


def manifest_path(token_file: str | os.PathLike[str]) -> Path:
    return Path(f"{token_file}.manifest.json")


def starts_path(token_file: str | os.PathLike[str]) -> Path:
    return Path(f"{token_file}.docs.npy")


def remove_manifest(token_file: str | os.PathLike[str]) -> None:
    manifest_path(token_file).unlink(missing_ok=True)
    starts_path(token_file).unlink(missing_ok=True)


def write_manifest(token_file: str | os.PathLike[str], manifest: dict[str, Any], starts: np.ndarray) -> Path:
    """Write the document starts and the manifest (each to a temp file renamed into place, manifest last)."""
    docs, path = starts_path(token_file), manifest_path(token_file)
    with atomic_path(docs) as tmp_docs:
        np.save(tmp_docs, np.asarray(starts, dtype=np.int64), allow_pickle=False)
    atomic_write(path, json.dumps({"format": FORMAT, "version": VERSION, **manifest,
                                   "document_starts": docs.name}, indent=2) + "\n")
    return path


def read_manifest(token_file: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest, or None when there is none or it does not describe the token file as it is now."""
    path = manifest_path(token_file)
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    from crosstrain.data.tokenfile import read_header

    if manifest.get("format") != FORMAT or int(manifest.get("tokens", -1)) != read_header(token_file)[1]:
        return None
    return manifest


def document_starts(token_file: str | os.PathLike[str], num_tokens: int) -> np.ndarray | None:
    """Token offsets where the documents of ``token_file`` start (sorted, first 0), or None if not recorded."""
    if read_manifest(token_file) is None or not starts_path(token_file).is_file():
        return None
    starts = np.load(starts_path(token_file), allow_pickle=False)
    ok = starts.ndim == 1 and len(starts) and starts[0] == 0 and bool(np.all(np.diff(starts) > 0))
    if not ok or int(starts[-1]) >= num_tokens:
        return None
    return starts.astype(np.int64, copy=False)


def check_tokenizer(token_file: str, tokenizer: str) -> None:
    """ConfigError unless ``token_file`` was prepared with ``tokenizer`` ("" = the byte tokenizer)."""
    from crosstrain.data.hf_tokenizer import describe_tokenizer

    manifest = read_manifest(token_file)
    want = describe_tokenizer(tokenizer)
    if manifest is None:
        if want["type"] != "byte":
            raise ConfigError(f"data.path {token_file!r} has no manifest recording its tokenizer; prepare it with "
                              f"'crosstrain data prepare ... --tokenizer {tokenizer}'")
        return
    got = manifest.get("tokenizer", {})
    if got.get("type") != want["type"] or got.get("sha256") != want.get("sha256"):
        used = got.get("path") or got.get("type")
        raise ConfigError(f"data.path {token_file!r} was prepared with tokenizer {used!r}, not data.tokenizer="
                          f"{tokenizer or 'byte'!r}; set data.tokenizer to the tokenizer it was prepared with or "
                          "prepare it again")
