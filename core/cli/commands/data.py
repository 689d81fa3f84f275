"""``crosstrain data prepare FILES... --out data.bin`` and ``crosstrain data info data.bin``."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import numpy as np

CHUNK = 1 << 24


def _chunks(files: list[str], tokenizer: object) -> Iterator[np.ndarray]:
    for i, name in enumerate(files):
        if i:
            yield tokenizer.encode(b"\n\n")  # type: ignore[attr-defined]
        with open(name, "rb") as fh:
            while True:
                block = fh.read(CHUNK)
                if not block:
                    break
                yield tokenizer.encode(block)  # type: ignore[attr-defined]


def prepare(args: argparse.Namespace) -> int:
    from crosstrain.data.tokenfile import write_token_file
    from crosstrain.data.tokenizer import ByteTokenizer
    from crosstrain.errors import ConfigError

    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        raise ConfigError(f"input file {missing[0]!r} does not exist")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ConfigError(f"--out {args.out!r}: folder {str(out.parent)!r} does not exist")
    tokenizer = ByteTokenizer()
    count = write_token_file(out, _chunks(args.files, tokenizer), tokenizer.vocab_size)
    print(f"wrote {count:,} tokens ({tokenizer.name} tokenizer, vocab {tokenizer.vocab_size}) to {out}")
    return 0


def info(args: argparse.Namespace) -> int:
    from crosstrain.data.tokenfile import read_header

    itemsize, count, vocab = read_header(args.file)
    print(f"{args.file}: {count:,} tokens, vocab {vocab}, {itemsize} byte(s) per token")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare token files for training")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = dsub.add_parser("prepare", help="tokenize text files into one memory-mappable token file")
    prep.add_argument("files", nargs="+", help="text files")
    prep.add_argument("--out", required=True, help="output token file (e.g. data.bin)")
    prep.add_argument("--tokenizer", choices=["byte"], default="byte")
    prep.set_defaults(func=prepare)
    inf = dsub.add_parser("info", help="describe a token file")
    inf.add_argument("file")
    inf.set_defaults(func=info)
