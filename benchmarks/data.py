"""Data path throughput, side by side in one run: preparing JSONL, and the training loader vs training itself.

1. Prepare: ``--mb`` MB of JSONL documents (paragraphs of the embedded corpus, shuffled into documents of 1-12
   paragraphs) are tokenised into a token file with EOS between documents by

   - crosstrain: :func:`crosstrain.data.prepare.prepare` (what ``crosstrain data prepare`` runs) with
     ``--workers`` processes;
   - datasets: the plain Hugging Face approach on the same ``tokenizers`` tokenizer: ``load_dataset("json")``,
     ``Dataset.map(batched=True)`` calling ``Tokenizer.encode_batch`` (its Rust thread pool uses every core),
     then the ids concatenated with EOS and written as one array. Needs the ``datasets`` package, which
     crosstrain itself never uses; without it the ratio is reported as null.

   Both outputs are compared token for token. ``prepare_vs_datasets`` = datasets time / crosstrain time
   (goal >= 1.5 with 2 workers).
2. Loader: the training loader (``DistributedBatchSampler`` + ``TokenDataset`` on the memory-mapped file, plus the
   packed variant with document ids), batch 8 x 128, against the ``small`` preset's training tokens/s (same batch,
   a short ``Trainer`` run on this machine). ``loader_headroom`` = loader tokens/s / training tokens/s
   (goal >= 50).

The tokenizer is a byte-level BPE (``--vocab-size``) trained on the embedded corpus, unless ``--tokenizer DIR``.
Last line: JSON ``{"prepare_vs_datasets", "loader_headroom", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def make_jsonl(path: Path, megabytes: float, seed: int = 0) -> int:
    """Write documents of 1-12 corpus paragraphs until ``megabytes``; returns the document count."""
    from crosstrain.data.corpus import corpus_bytes

    paragraphs = [p for p in corpus_bytes().decode("ascii").split("\n\n") if p.strip()]
    rng = random.Random(seed)
    target, size, docs = int(megabytes * 1e6), 0, 0
    with path.open("w") as fh:
        while size < target:
            text = "\n\n".join(rng.choices(paragraphs, k=rng.randint(1, 12)))
            line = json.dumps({"id": docs, "text": text}) + "\n"
            fh.write(line)
            size += len(line)
            docs += 1
    return docs


def crosstrain_prepare(jsonl: Path, out: Path, tokenizer: str, workers: int) -> tuple[float, np.ndarray]:
    from crosstrain.data.prepare import prepare
    from crosstrain.data.tokenfile import open_token_file

    t0 = time.perf_counter()
    prepare([str(jsonl)], out, tokenizer=tokenizer, workers=workers)
    seconds = time.perf_counter() - t0
    return seconds, open_token_file(out)[0]


def datasets_prepare(jsonl: Path, out: Path, tokenizer: str, eos: int, cache: Path) -> tuple[float, np.ndarray]:
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
    ds = datasets.load_dataset("json", data_files=str(jsonl), split="train", cache_dir=str(cache))

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {"ids": [e.ids for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}

    ds = ds.map(encode, batched=True, remove_columns=ds.column_names)
    sep = np.asarray([eos], dtype=np.uint16)
    parts: list[np.ndarray] = []
    for batch in ds.iter(batch_size=4096):
        for ids in batch["ids"]:
            parts += [sep, np.asarray(ids, dtype=np.uint16)]
    tokens = np.concatenate(parts[1:])
    tokens.tofile(out)
    return time.perf_counter() - t0, tokens


def loader_tokens_per_s(path: Path, batch: int, seq_len: int, seconds: float = 2.0, packed: bool = False) -> float:
    from crosstrain.data.dataset import build_dataset
    from crosstrain.data.sampler import DistributedBatchSampler

    ds: Any = build_dataset(str(path), seq_len)
    if packed:
        from crosstrain.data.manifest import document_starts
        from crosstrain.data.packing import PackedDataset

        starts = document_starts(path, len(ds.tokens))
        assert starts is not None
        ds = PackedDataset(ds, starts)
    sampler = DistributedBatchSampler(len(ds), batch, seed=0)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for micro in sampler.next_step():
            ds.batch(micro)
        steps += 1
    return steps * batch * seq_len / (time.perf_counter() - t0)


def small_training_tokens_per_s(workdir: Path, batch: int, seq_len: int, steps: int) -> float:
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    config = load_config(None, ["model.preset=small", f"train.steps={steps}", f"train.batch_size={batch}",
                                f"train.seq_len={seq_len}", "logging.progress=none", "eval.every=0",
                                "logging.tensorboard=false"])
    summary = Trainer(config, run_dir=workdir / "small-run").fit()
    return float(summary["tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="JSONL size to prepare")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer", default="", help="a tokenizer folder (default: BPE trained on the corpus)")
    parser.add_argument("--train-steps", type=int, default=12, help="steps of the small preset to time")
    args = parser.parse_args()
    from crosstrain.data.hf_tokenizer import describe_tokenizer
    from crosstrain.data.tokenizer_train import train_bpe

    result: dict[str, Any] = {"mb": args.mb, "workers": args.workers, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="crosstrain-bench-data-") as tmp:
        root = Path(tmp)
        tokenizer = args.tokenizer or str(train_bpe([], args.vocab_size, root / "tok"))
        info = describe_tokenizer(tokenizer)
        jsonl = root / "docs.jsonl"
        result["documents"] = make_jsonl(jsonl, args.mb)
        ours_s, ours = crosstrain_prepare(jsonl, root / "ours.bin", tokenizer, args.workers)
        result.update(tokens=int(len(ours)), crosstrain_prepare_s=round(ours_s, 2),
                      crosstrain_mb_per_s=round(args.mb / ours_s, 2))
        print(f"crosstrain data prepare ({args.workers} workers): {ours_s:.1f}s, {len(ours):,} tokens", flush=True)
        try:
            import datasets  # noqa: F401

            theirs_s, theirs = datasets_prepare(jsonl, root / "theirs.bin", tokenizer, int(info["eos_id"]),
                                                root / "hf-cache")
            result.update(datasets_prepare_s=round(theirs_s, 2), identical_tokens=bool(np.array_equal(ours, theirs)),
                          prepare_vs_datasets=round(theirs_s / ours_s, 3))
            print(f"datasets.map + tokenizers: {theirs_s:.1f}s (identical tokens: {result['identical_tokens']})",
                  flush=True)
        except ImportError:
            result.update(prepare_vs_datasets=None, datasets_prepare_s=None,
                          note="the datasets package is not installed (pip install datasets); ratio not measured")
            print(result["note"], file=sys.stderr)
        batch, seq_len = 8, 128
        loader = loader_tokens_per_s(root / "ours.bin", batch, seq_len)
        packed = loader_tokens_per_s(root / "ours.bin", batch, seq_len, packed=True)
        train = small_training_tokens_per_s(root, batch, seq_len, args.train_steps)
        result.update(loader_tokens_per_s=round(loader), packed_loader_tokens_per_s=round(packed),
                      small_train_tokens_per_s=round(train, 1), loader_headroom=round(loader / train, 1),
                      packed_loader_headroom=round(packed / train, 1))
        print(f"loader {loader:,.0f} tok/s (packed {packed:,.0f}), small preset training {train:,.0f} tok/s",
              flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
