"""``crosstrain data prepare [FILES...] --out data.bin``, ``crosstrain data info data.bin`` and
``crosstrain data show --recipe R [--set k=v ...] [--rows N] [--json]``."""

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


def show(args: argparse.Namespace) -> int:
    """The first rows of a JSONL recipe's training data as its loss sees them: the recipe's own ``validate`` reads,
    renders, tokenises and truncates them (no second code path), ``show_data`` hands them back."""
    import json

    from crosstrain.config import load_config
    from crosstrain.engine.recipe import resolve_recipe
    from crosstrain.errors import ConfigError

    if args.rows < 1:
        raise ConfigError(f"--rows must be >= 1, got {args.rows}")
    overrides = [*(args.set or []), *([f"train.recipe={args.recipe}"] if args.recipe else [])]
    config = load_config(args.config, overrides)
    recipe = resolve_recipe(config.train.recipe)
    recipe.validate(config)
    shown = recipe.show_data(args.rows)
    doc = {"recipe": config.train.recipe, "tokenizer": config.data.tokenizer or "byte", **shown}
    rows = doc["rows"]
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"recipe {doc['recipe']}, tokenizer {doc['tokenizer']}, chat template {doc.get('chat_template')}, "
          f"data {doc.get('source')}")
    for i, row in enumerate(rows):
        for part, r in ([("", row)] if "text" in row else list(row.items())):
            trained = sum(r["loss_mask"])
            print(f"--- row {i}{' ' + part if part else ''}: {len(r['input_ids'])} tokens, {trained} in the loss"
                  f"{' (truncated)' if r.get('truncated') else ''}")
            print(r["text"])
            if "trained_text" in r:
                print(f"--- in the loss: {r['trained_text']!r}")
            print(f"--- input_ids: {r['input_ids']}")
            print(f"--- loss_mask: {''.join(str(m) for m in r['loss_mask'])}")
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
    sh = dsub.add_parser("show", help="a recipe's first training rows: rendered text, input ids and loss mask",
                         description="Reads, renders (data.chat_template), tokenises and truncates the rows with the "
                                     "recipe's own code, so what it prints is what training sees.")
    sh.add_argument("config", nargs="?", default=None, help="TOML config file (optional)")
    sh.add_argument("--recipe", default=None, metavar="NAME", help="sft, rm, dpo, grpo or ppo (train.recipe)")
    sh.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key, as in crosstrain train")
    sh.add_argument("--rows", type=int, default=3, help="how many rows (default 3)")
    sh.add_argument("--json", action="store_true", help="one JSON object: recipe, tokenizer, chat_template, rows")
    sh.set_defaults(func=show)
