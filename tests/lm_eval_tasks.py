"""Local lm-evaluation-harness task YAMLs over JSONL files written into a folder (``dataset_path: json``), so
nothing downloads: the tasks tests/test_eval_tasks.py and tests/test_lmeval_serve.py score."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ["lantern", "river", "stone", "garden", "window", "bridge", "candle"]


def mc_task(root: Path, items: int = 60) -> Path:
    """A multiple-choice task: which word ends the sentence (3 choices)."""
    with open(root / "mc.jsonl", "w") as f:
        for i in range(items):
            a, b, c = WORDS[i % 7], WORDS[(i + 2) % 7], WORDS[(i + 5) % 7]
            f.write(json.dumps({"q": f"Ada found the {a} by the", "choices": [b, c, a][i % 3:] + [b, c, a][:i % 3],
                                "label": (2 - i % 3) % 3}) + "\n")
    path = root / "mc.yaml"
    path.write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    return path


def rolling_task(root: Path) -> Path:
    """Perplexity of whole texts longer than the model's 256-token context (several rolling windows each)."""
    with open(root / "roll.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"text": " ".join(f"The {WORDS[(i + j) % 7]} and the {WORDS[j % 7]}." for j in
                                                 range(12 + 6 * i))}) + "\n")
    path = root / "roll.yaml"
    path.write_text(f"""task: tiny_roll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'roll.jsonl'}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
    return path


def gen_task(root: Path, until: str) -> Path:
    with open(root / "gen.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"q": f"The {WORDS[i]} and the", "a": WORDS[i + 1]}) + "\n")
    path = root / "gen.yaml"
    path.write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: [{json.dumps(until)}]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return path
