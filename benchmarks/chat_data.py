"""Cost of rendering conversation rows with a chat template (``data.chat_template``) before training.

Builds the Llama-3-style tokenizer of tests/chat_tokenizer.py, writes ``--rows`` conversations (the fixture's four,
repeated) and times ``crosstrain.plugins.rlhf.data`` reading and encoding them as ``--recipe sft`` does: with the
tokenizer's template (transformers' ``apply_chat_template``, one render per assistant turn and its prefix) and
with crosstrain's own format (``data.chat_template=none``). Last line JSON: rows per second of each and their
ratio.

    python benchmarks/chat_data.py [--rows 2000]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    args = parser.parse_args()
    from chat_tokenizer import CONVERSATIONS, build_tokenizer, write_jsonl

    from crosstrain.data import chat_template
    from crosstrain.data.hf_tokenizer import load_tokenizer
    from crosstrain.plugins.rlhf import data

    out: dict[str, float | int] = {"rows": args.rows}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tokenizer(Path(tmp) / "tok")
        path = write_jsonl(Path(tmp) / "rows.jsonl", [CONVERSATIONS[i % 4] for i in range(args.rows)])
        tok = load_tokenizer(str(folder))
        for setting in ("auto", "none"):
            chat = chat_template.resolve(setting, str(folder))
            start = time.perf_counter()
            rows, _ = data.read_jsonl(str(path), functools.partial(data.parse_sft_row, chat=chat), skip_bad_rows=False)
            dataset = data.encode_sft(tok, rows, 512, 256)
            seconds = time.perf_counter() - start
            out[f"rows_per_s_{setting}"] = round(len(dataset) / seconds, 1)
            out[f"tokens_{setting}"] = sum(len(r.ids) for r in dataset.rows)
    out["template_over_none_time"] = round(out["rows_per_s_none"] / out["rows_per_s_auto"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
