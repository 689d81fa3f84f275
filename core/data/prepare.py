"""``crosstrain data prepare``: text, JSONL and Parquet documents -> one memory-mapped token file + manifest.

Work units (:mod:`crosstrain.data.sources`) are tokenised by a pool of processes and written in input order, so
the file is the same for any number of workers. Documents are separated by the tokenizer's EOS token (the byte
tokenizer, which has none, keeps its blank line ``\\n\\n``); the manifest records where each document starts.
With several workers each process encodes sequentially (``TOKENIZERS_PARALLELISM=false``) so processes, not
threads inside each, share the cores; a single worker lets ``tokenizers`` use its own thread pool.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from crosstrain.data.sources import Unit, iter_documents, plan_units
from crosstrain.errors import ConfigError

_STATE: dict[str, Any] = {}


def _init_worker(tokenizer: str, text_field: str, separator: list[int], dtype: str, sequential: bool) -> None:
    if sequential:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from crosstrain.data.hf_tokenizer import load_tokenizer

    _STATE.update(tokenizer=load_tokenizer(tokenizer), field=text_field,
                  separator=np.asarray(separator, dtype=dtype), dtype=dtype)


def encode_unit(unit: Unit) -> tuple[str, np.ndarray, np.ndarray]:
    """``(path, tokens, starts)``: every non-empty document preceded by the separator, and the offsets (within
    ``tokens``) where the documents start."""
    tok, sep, dtype = _STATE["tokenizer"], _STATE["separator"], _STATE["dtype"]
    docs = [d for d in iter_documents(unit, _STATE["field"]) if d]
    if hasattr(tok, "encode_batch"):
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
        encoded = [np.asarray(ids, dtype=dtype) for ids in tok.encode_batch(texts)]
    else:
        encoded = [tok.encode(d).astype(dtype, copy=False) for d in docs]
    parts: list[np.ndarray] = []
    starts = np.empty(len(encoded), dtype=np.int64)
    pos = 0
    for i, ids in enumerate(encoded):
        parts += [sep, ids]
        starts[i] = pos + len(sep)
        pos += len(sep) + len(ids)
    tokens = np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
    return unit.path, tokens, starts


def _separator(info: dict[str, Any], tokenizer: str) -> list[int]:
    if info["eos_id"] is not None:
        return [int(info["eos_id"])]
    from crosstrain.data.hf_tokenizer import load_tokenizer

    return [int(i) for i in load_tokenizer(tokenizer).encode("\n\n")]


def prepare(
    inputs: list[str], out: str | os.PathLike[str], *, tokenizer: str = "", text_field: str = "text",
    workers: int = 0,
) -> dict[str, Any]:
    """Tokenise ``inputs`` (none = the embedded corpus) into the token file ``out``; returns the manifest."""
    from crosstrain.data.hf_tokenizer import describe_tokenizer
    from crosstrain.data.manifest import remove_manifest, write_manifest
    from crosstrain.data.tokenfile import itemsize_for, write_token_file

    t0 = time.perf_counter()
    info = describe_tokenizer(tokenizer)
    units = plan_units(inputs) if inputs else [Unit("", "corpus")]
    workers = max(1, min(workers or (os.cpu_count() or 1), len(units)))
    separator = _separator(info, tokenizer)
    dtype = f"uint{8 * itemsize_for(int(info['vocab_size']))}"  # the token file's own width: less to pickle back
    args = (tokenizer, text_field, separator, dtype, workers > 1)
    per_input: dict[str, dict[str, Any]] = {}
    all_starts: list[np.ndarray] = []
    written = 0

    def chunks(results: Iterator[tuple[str, np.ndarray, np.ndarray]]) -> Iterator[np.ndarray]:
        nonlocal written
        for path, tokens, starts in results:
            if written == 0 and len(starts):  # the file's first document has no separator before it
                remove_manifest(out)  # (and the old manifest goes with the old data it describes)
                tokens, starts = tokens[len(separator):], starts - len(separator)
            all_starts.append(starts + written)
            stats = per_input.setdefault(path or "<embedded corpus>", {"documents": 0, "tokens": 0})
            stats["documents"] += len(starts)
            stats["tokens"] += len(tokens)
            written += len(tokens)
            yield tokens
        if written == 0:  # raised inside write_token_file: its temp file goes, an existing out stays as it was
            raise ConfigError(f"the inputs hold no text to tokenise (no non-empty {text_field!r} documents); nothing "
                              f"written to {out}")

    if workers > 1:
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        with ctx.Pool(workers, initializer=_init_worker, initargs=args) as pool:
            count = write_token_file(out, chunks(pool.imap(encode_unit, units, chunksize=1)), int(info["vocab_size"]))
    else:
        _init_worker(*args)
        count = write_token_file(out, chunks(map(encode_unit, units)), int(info["vocab_size"]))
    starts = np.concatenate(all_starts) if all_starts else np.empty(0, dtype=np.int64)
    seconds = time.perf_counter() - t0
    manifest = {
        "tokens": count, "documents": int(len(starts)), "tokenizer": info, "separator": separator,
        "text_field": text_field, "workers": workers, "seconds": round(seconds, 3),
        "inputs": [{"path": p, **s} for p, s in per_input.items()],
    }
    write_manifest(out, manifest, starts)
    return manifest
