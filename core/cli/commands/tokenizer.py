"""``crosstrain tokenizer train --vocab-size N --out DIR [INPUTS...]`` (byte-level BPE, needs ``tokenizers``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def train(args: argparse.Namespace) -> int:
    from crosstrain.data.hf_tokenizer import describe_tokenizer
    from crosstrain.data.tokenizer_train import train_bpe
    from crosstrain.errors import ConfigError

    missing = [f for f in args.inputs if not Path(f).is_file()]
    if missing:
        raise ConfigError(f"input file {missing[0]!r} does not exist")
    t0 = time.perf_counter()
    out = train_bpe(args.inputs, args.vocab_size, args.out, text_field=args.text_field,
                    min_frequency=args.min_frequency)
    info = describe_tokenizer(str(out))
    print(f"wrote {out}/tokenizer.json (vocab {info['vocab_size']}, eos {info['eos_token']!r} = id {info['eos_id']}, "
          f"sha256 {info['sha256'][:12]}) in {time.perf_counter() - t0:.1f}s; use it with "
          f"'crosstrain data prepare ... --tokenizer {out}' and data.tokenizer={out}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="train a tokenizer (byte-level BPE)")
    tsub = p.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    t = tsub.add_parser("train", help="train a byte-level BPE tokenizer into a folder AutoTokenizer loads",
                        description="Documents as in 'crosstrain data prepare'; no inputs: the embedded corpus.")
    t.add_argument("inputs", nargs="*", help="text, .jsonl/.ndjson or .parquet files (none: the embedded corpus)")
    t.add_argument("--vocab-size", type=int, required=True, help="vocabulary size (>= 257), special token included")
    t.add_argument("--out", required=True, help="output folder (tokenizer.json, tokenizer_config.json)")
    t.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    t.add_argument("--min-frequency", type=int, default=2, help="merge only pairs seen at least this often")
    t.set_defaults(func=train)
