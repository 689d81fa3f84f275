"""``crosstrain data prepare [FILES...] --out data.bin`` and ``crosstrain data info data.bin``."""

from __future__ import annotations

import argparse
from pathlib import Path


def prepare(args: argparse.Namespace) -> int:
    from crosstrain.data.prepare import prepare as run_prepare
    from crosstrain.errors import ConfigError

    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        raise ConfigError(f"input file {missing[0]!r} does not exist")
    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"--out {args.out!r} is a folder; pass a file name (e.g. {str(out / 'data.bin')!r})")
    empty = [f for f in args.files if Path(f).stat().st_size == 0]
    if empty:
        raise ConfigError(f"input file {empty[0]!r} is empty; pass files with text in them")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {args.out!r}: folder {str(out.parent)!r} does not exist")
    if args.workers < 0:
        raise ConfigError(f"--workers must be >= 0 (0 = one per CPU core), got {args.workers}")
    tokenizer = "" if args.tokenizer == "byte" else args.tokenizer
    manifest = run_prepare(args.files, out, tokenizer=tokenizer, text_field=args.text_field, workers=args.workers)
    tok = manifest["tokenizer"]
    name = "byte" if tok["type"] == "byte" else tok["path"]
    rate = manifest["tokens"] / max(manifest["seconds"], 1e-9)
    print(f"wrote {manifest['tokens']:,} tokens, {manifest['documents']:,} documents ({name} tokenizer, vocab "
          f"{tok['vocab_size']}) to {out} in {manifest['seconds']:.1f}s ({rate:,.0f} tokens/s, "
          f"{manifest['workers']} worker{'s' if manifest['workers'] > 1 else ''})")
    return 0


def info(args: argparse.Namespace) -> int:
    from crosstrain.data.manifest import read_manifest
    from crosstrain.data.tokenfile import read_header

    itemsize, count, vocab = read_header(args.file)
    print(f"{args.file}: {count:,} tokens, vocab {vocab}, {itemsize} byte(s) per token")
    manifest = read_manifest(args.file)
    if manifest is not None:
        tok = manifest["tokenizer"]
        name = "byte" if tok["type"] == "byte" else f"{tok['path']} (sha256 {tok['sha256'][:12]})"
        print(f"  {manifest['documents']:,} documents, tokenizer {name}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare token files for training")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = dsub.add_parser("prepare", help="tokenize text, JSONL or Parquet files into one memory-mappable token file",
                           description="Documents: a whole text file, a JSONL record's text field, a Parquet row's "
                                       "text column. No files: the embedded corpus (its chapters).")
    prep.add_argument("files", nargs="*", help="text, .jsonl/.ndjson or .parquet files (none: the embedded corpus)")
    prep.add_argument("--out", required=True, help="output token file (e.g. data.bin), with a manifest next to it")
    prep.add_argument("--tokenizer", default="byte", help='"byte" (default) or a folder with a tokenizer.json')
    prep.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    prep.add_argument("--workers", type=int, default=0, help="tokenizing processes (0 = one per CPU core)")
    prep.set_defaults(func=prepare)
    inf = dsub.add_parser("info", help="describe a token file")
    inf.add_argument("file")
    inf.set_defaults(func=info)
