"""Every bad input on the plugin surfaces gets one line (issue 27): rlhf recipes and their data, LoRA, MoE,
``model.init_from`` sources, export/generate/eval sources, observability (report, Prometheus, profiler),
``data prepare``, tokenizers and checkpoint pointers.

Each case runs ``crosstrain ...`` in this process (tests/in_process.py) and must exit non-zero with no traceback,
at most two lines on stderr ending in ``crosstrain: error:``, no run dir for an error found before training
(cases marked ``RUNS`` fail while training, when the run dir exists by design), no output file of a refused
``data prepare``/``report``, and every file of the existing run dirs byte for byte as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from in_process import crosstrain_main
from one_line import one_line_error
from test_bad_inputs import SMALL, snapshot

T = [*SMALL, "--set", "backend=cpu", "--set", "train.steps=2", "--set", "eval.every=0"]
RUNS = "runs"  # the case fails while training: its run dir exists by then


def _tr(recipe: str, *sets: str) -> list[str]:
    """``train --recipe RECIPE *T --set A --set B ...``."""
    argv = ["train", "--recipe", recipe, *T]
    for s in sets:
        argv += ["--set", s]
    return argv


def _cfg(recipe: str, key: str, value: str, needle: str | None = None) -> tuple[str, list[str], str, str]:
    """A bad config value of a plugin section: refused by its schema, exit 2, naming the key."""
    return (f"{recipe}-{key}={value}", _tr(recipe, f"{key}={value}"), needle or f"'{key}'", "")


#: (id, argv with {w} {run} {bestbad} {bestgone} placeholders, text the output must contain, flags)
CASES: list[tuple[str, list[str], str, str]] = [
    # -- rlhf sections: schema (exit 2 before anything is built)
    *[_cfg("dpo", k, v) for k, v in [
        ("rlhf.beta", "0"), ("rlhf.beta", "-1"), ("rlhf.loss_type", "kto"), ("rlhf.label_smoothing", "0.5"),
        ("rlhf.label_smoothing", "-0.1"), ("rlhf.max_length", "-1"), ("rlhf.max_prompt_length", "-1"),
        ("rlhf.reference", "cached"), ("rlhf.max_new_tokens", "0"), ("rlhf.center_rewards_coefficient", "-1")]],
    ("rlhf-unknown-key", _tr("dpo", "rlhf.betta=1"), "unknown config key 'rlhf.betta'", ""),
    ("rlhf-section-scalar", _tr("dpo", "rlhf=3"), "rlhf", ""),
    ("dpo-max-length-too-long", _tr("dpo", "rlhf.max_length=100000"), "exceeds the model's max_seq_len", ""),
    ("sft-packing-documents", _tr("sft", "data.packing=documents"), "does not pack documents", ""),
    ("rm-packing-documents", _tr("rm", "data.packing=documents"), "does not pack documents", ""),
    # -- distill (tests/test_distill_recipe.py has the cases that need a cache file)
    ("distill-no-teacher", _tr("distill"), "needs a teacher: set distill.teacher", ""),
    ("distill-top-k-above-vocab", _tr("distill", "distill.teacher={run}", "distill.top_k_logits=100000"),
     "distill.top_k_logits=100000 exceeds the vocabulary of 256 tokens", ""),
    # -- lora
    *[_cfg("sft", k, v) for k, v in [("lora.rank", "-1"), ("lora.alpha", "0"), ("lora.dropout", "1"),
                                      ("lora.dropout", "-0.5")]],
    ("lora-targets-none", _tr("sft", "lora.rank=4", 'lora.targets=["nope"]'), "matches no nn.Linear", ""),
    ("lora-with-lm", _tr("lm", "lora.rank=4"), "train.recipe='lm' would ignore it; set lora.rank=0", ""),
    ("lora-rank-above-dim", _tr("sft", "lora.rank=100000"), "lora.rank=100000 exceeds the smallest", ""),
    ("lora-rank-65", _tr("dpo", "lora.rank=65"), "set lora.rank <= 64", ""),
    ("lora-with-grpo", _tr("grpo", "lora.rank=4"), "train.recipe='grpo' would ignore it", ""),
    ("lora-with-ppo", _tr("ppo", "lora.rank=4"), "train.recipe='ppo' would ignore it", ""),
    # -- rl and reward sections
    *[_cfg("grpo", k, v) for k, v in [
        ("rl.num_generations", "0"), ("rl.max_new_tokens", "0"), ("rl.advantage", "gae"),
        ("rl.scale_rewards", "all"), ("rl.importance_sampling_level", "batch"), ("rl.epsilon", "0"),
        ("rl.epsilon", "1"), ("rl.epsilon_high", "0"), ("rl.dual_clip", "-1"), ("rl.aggregation", "sum"),
        ("rl.beta", "-1"), ("rl.kl_estimator", "k4"), ("rl.kl_clamp", "-1"), ("rl.kl_in", "value"),
        ("rl.kl_target", "-1"), ("rl.kl_horizon", "0"), ("rl.gamma", "2"), ("rl.lam", "-0.1"),
        ("rl.vf_coef", "-1"), ("rl.cliprange_value", "-1"), ("rl.entropy_coef", "-1")]],
    ("reward-fn-form", _tr("grpo", "reward.fn=nocolon"), "must look like 'package.module:name'", ""),
    ("reward-fn-module", _tr("grpo", "reward.fn=no_such_mod_27:fn"), "cannot import", ""),
    ("reward-fn-attr", _tr("grpo", "reward.fn=os:no_such_fn_27"), "has no attribute", ""),
    ("reward-fn-not-callable", _tr("grpo", "reward.fn=os:sep"), "is not callable", ""),
    ("reward-fn-and-model", _tr("grpo", "reward.fn=bi_rewards:boom", "reward.model={run}"), "not both", ""),
    ("reward-model-missing", _tr("grpo", "reward.model={w}/missing"), "does not exist", ""),
    ("reward-fn-raises", _tr("grpo", "reward.fn=bi_rewards:boom"),
     "reward.fn bi_rewards:boom raised RuntimeError: kaboom at step 1", RUNS),
    ("reward-fn-count", _tr("grpo", "reward.fn=bi_rewards:one"), "return one float per completion", RUNS),
    ("reward-fn-nan", _tr("grpo", "reward.fn=bi_rewards:nan"), "returned a non-finite reward", RUNS),
    # -- rlhf data
    ("sft-data-missing", _tr("sft", "data.path={w}/missing.jsonl"), "fix the path of the file recipe 'sft'", ""),
    ("dpo-data-missing", _tr("dpo", "data.path={w}/missing.jsonl"), "recipe 'dpo' reads", ""),
    ("grpo-data-missing", _tr("grpo", "data.path={w}/missing.jsonl"), "recipe 'grpo' reads", ""),
    ("sft-data-folder", _tr("sft", "data.path={w}"), "does not exist", ""),
    ("dpo-not-utf8", _tr("dpo", "data.path={w}/latin1.jsonl"), "latin1.jsonl:1: not UTF-8 text", ""),
    ("sft-not-utf8", _tr("sft", "data.path={w}/latin1.jsonl"), "not UTF-8 text", ""),
    ("dpo-token-file", _tr("dpo", "data.path={w}/tokens.bin"), "is a crosstrain token file", ""),
    ("sft-token-file", _tr("sft", "data.path={w}/tokens.bin"), "is a crosstrain token file", ""),
    ("grpo-token-file", _tr("grpo", "data.path={w}/tokens.bin"), "is a crosstrain token file", ""),
    ("dpo-binary-junk", _tr("dpo", "data.path={w}/junk.jsonl"), "junk.jsonl:1:", ""),
    ("dpo-not-json", _tr("dpo", "data.path={w}/text.jsonl"), "not valid JSON", ""),
    ("dpo-row-no-rejected", _tr("dpo", "data.path={w}/no_rejected.jsonl"), "no_rejected.jsonl:1:", ""),
    ("dpo-row-int-chosen", _tr("dpo", "data.path={w}/int_chosen.jsonl"), "'chosen' must be a string", ""),
    ("dpo-row-is-a-list", _tr("dpo", "data.path={w}/list_row.jsonl"), "list_row.jsonl:1:", ""),
    ("sft-row-no-completion", _tr("sft", "data.path={w}/no_rejected.jsonl"), "no_rejected.jsonl:1:", ""),
    ("sft-messages-bad-role", _tr("sft", "data.path={w}/bad_role.jsonl"), "each message needs a role", ""),
    ("sft-messages-empty", _tr("sft", "data.path={w}/empty_messages.jsonl"), "messages must be a non-empty", ""),
    ("dpo-empty-file", _tr("dpo", "data.path={w}/empty.jsonl"), "has no usable rows", ""),
    ("dpo-all-bad-skipped", _tr("dpo", "data.path={w}/text.jsonl", "data.skip_bad_rows=true"),
     "has no usable rows (", ""),
    ("dpo-chosen-equals-rejected", _tr("dpo", "data.path={w}/ties.jsonl"), "has chosen == rejected", ""),
    ("rm-chosen-equals-rejected", _tr("rm", "data.path={w}/ties.jsonl"), "nothing to learn", ""),
    ("dpo-val-missing", _tr("dpo", "data.path={w}/pairs.jsonl", "data.val_path={w}/missing.jsonl"),
     "does not exist", ""),
    ("dpo-val-bad-row", _tr("dpo", "data.path={w}/pairs.jsonl", "data.val_path={w}/no_rejected.jsonl"),
     "no_rejected.jsonl:1:", ""),
    ("grpo-prompt-missing", _tr("grpo", "data.path={w}/no_prompt.jsonl"), "needs a non-empty string \"prompt\"", ""),
    ("rm-tied-embeddings", _tr("rm", "model.tie_embeddings=true"), "tie", ""),
    # -- model.init_from sources
    ("init-from-truncated", _tr("sft", "model.init_from={w}/trunc.safetensors"), "truncated or not safetensors", ""),
    ("init-from-garbage", _tr("lm", "model.init_from={w}/garbage.safetensors"), "is not a readable safetensors", ""),
    ("init-from-empty-file", _tr("lm", "model.init_from={w}/empty.safetensors"), "is not a readable safetensors", ""),
    ("init-from-wrong-tensors", _tr("lm", "model.init_from={w}/other.safetensors"), "does not fit this model", ""),
    ("init-from-hf-garbage", _tr("lm", "model.init_from={w}/hf_garbage"), "hf_garbage/model.safetensors is not", ""),
    ("init-from-hf-truncated", _tr("dpo", "model.init_from={w}/hf_trunc"), "truncated or not safetensors", ""),
    ("init-from-broken-config", _tr("lm", "model.init_from={w}/hf_broken"), "config.json is not valid JSON", ""),
    ("init-from-config-no-type", _tr("lm", "model.init_from={w}/hf_no_type"), "has no model_type", ""),
    ("init-from-pickle-only", _tr("lm", "model.init_from={w}/hf_bin"), "only pickle weights", ""),
    ("init-from-index-missing-shard", _tr("lm", "model.init_from={w}/hf_index"), "which is missing", ""),
    ("init-from-index-garbage", _tr("lm", "model.init_from={w}/hf_index_bad"), "is not a safetensors index", ""),
    ("init-from-missing", _tr("lm", "model.init_from={w}/missing"), "does not exist", ""),
    ("init-from-empty-folder", _tr("lm", "model.init_from={w}/emptydir"), "model.init_from", ""),
    ("init-from-other-width", _tr("lm", "model.init_from={run}", "model.dim=96", "model.n_heads=4"),
     "does not match model.init_from", ""),
    ("init-from-with-import-path", _tr("lm", "model.init_from={run}", "model.import_path=os:getcwd"),
     "cannot be combined with model.import_path", ""),
    ("init-from-hf-with-dim", _tr("lm", "model.init_from={w}/hf_garbage", "model.dim=32"),
     "cannot be combined with model.init_from", ""),
    ("init-from-corrupt-run", _tr("lm", "model.init_from={corrupt}"), "every step_N failed verification", ""),
    # -- export / generate / eval sources
    ("generate-garbage", ["generate", "{w}/garbage.safetensors", "--prompt", "hi"], "is not a readable", ""),
    ("generate-truncated", ["generate", "{w}/trunc.safetensors", "--prompt", "hi"], "is not a readable", ""),
    ("generate-empty-file", ["generate", "{w}/empty.safetensors", "--prompt", "hi"], "is not a readable", ""),
    ("generate-hf-garbage", ["generate", "{w}/hf_garbage", "--prompt", "hi"], "is not a readable safetensors", ""),
    ("generate-hf-truncated", ["generate", "{w}/hf_trunc", "--prompt", "hi"], "truncated or not safetensors", ""),
    ("generate-hf-pickle", ["generate", "{w}/hf_bin", "--prompt", "hi"], "only pickle weights", ""),
    ("generate-no-config", ["generate", "{w}/other.safetensors", "--prompt", "hi"], "other.safetensors", ""),
    ("export-garbage", ["export", "{w}/garbage.safetensors"], "is not a readable safetensors", ""),
    ("export-truncated-onnx", ["export", "{w}/trunc.safetensors", "--format", "onnx", "--out", "{w}/o.onnx"],
     "is not a readable", ""),
    ("export-hf-garbage", ["export", "{w}/hf_garbage", "--out", "{w}/o.onnx"], "is not a readable safetensors", ""),
    ("export-hf-broken", ["export", "{w}/hf_broken", "--out", "{w}/o.onnx"], "hf_broken", ""),
    ("export-empty-folder", ["export", "{w}/emptydir"], "is empty", ""),
    ("export-best-step-folder", ["export", "{run}/checkpoints/step_2", "--best"], "pass the run dir", ""),
    # -- checkpoint pointers
    ("eval-best-garbage", ["eval", "{bestbad}", "--best"], "names no step_N folder (it is corrupt)", ""),
    ("export-best-garbage", ["export", "{bestbad}", "--best", "--out", "{w}/b.onnx"], "it is corrupt", ""),
    ("generate-best-garbage", ["generate", "{bestbad}", "--best", "--prompt", "hi"], "it is corrupt", ""),
    ("eval-best-gone", ["eval", "{bestgone}", "--best"], "naming step_99, which is unusable", ""),
    ("generate-best-gone", ["generate", "{bestgone}", "--best", "--prompt", "hi"], "step_99", ""),
    ("eval-best-none", ["eval", "{run}", "--best"], "train with checkpoint.keep_best=true", ""),
    ("eval-best-step-folder", ["eval", "{run}/checkpoints/step_2", "--best"], "pass the run dir", ""),
    # -- observability
    ("report-out-is-a-file", ["report", "{run}", "--out", "{w}/text.txt"], "is a file; pass a folder", ""),
    ("report-empty-metrics", ["report", "{emptymetrics}", "--out", "{w}/rep"], "no step records", ""),
    ("report-missing", ["report", "{w}/missing", "--out", "{w}/rep"], "is not a run dir", ""),
    ("report-not-a-run", ["report", "{w}/emptydir", "--out", "{w}/rep"], "is not a run dir", ""),
    ("report-second-missing", ["report", "{run}", "{w}/missing", "--out", "{w}/rep"], "is not a run dir", ""),
    ("profile-beyond-run", [*_tr("lm"), "--profile-steps", "5:6"], "ends after the last step", ""),
    ("profile-partly-beyond", [*_tr("lm"), "--profile-steps", "2:3"], "pick A:B with B <= 2", ""),
    ("profile-starts-at-1", [*_tr("lm"), "--profile-steps", "1:2"], "2 <= A <= B", ""),
    ("profile-reversed", [*_tr("lm"), "--profile-steps", "3:2"], "2 <= A <= B", ""),
    ("profile-text", [*_tr("lm"), "--profile-steps", "all"], "observability.profile_steps", ""),
    ("prometheus-host-999", _tr("lm", "observability.prometheus_port=19999", "observability.prometheus_host=999.1.1.1"),
     "'999.1.1.1' is not an IP address", ""),
    ("prometheus-host-empty", _tr("lm", "observability.prometheus_host="), "prometheus_host", ""),
    ("prometheus-port-70000", _tr("lm", "observability.prometheus_port=70000"), "prometheus_port", ""),
    ("prometheus-port-negative", _tr("lm", "observability.prometheus_port=-1"), "prometheus_port", ""),
    ("prometheus-host-not-local", _tr("lm", "observability.prometheus_port=19998",
                                      "observability.prometheus_host=203.0.113.7"),
     "prometheus_host '203.0.113.7' is not an address of this machine", RUNS),
    ("prometheus-port-busy", ["train", "--run-dir", "{run}", *T, "--set", "train.steps=4", "--set",
                              "observability.prometheus_port={port}"], "is not free", ""),
    ("straggler-fraction-0", _tr("lm", "observability.straggler_fraction=0"), "straggler_fraction", ""),
    ("straggler-steps-0", _tr("lm", "observability.straggler_steps=0"), "straggler_steps", ""),
    ("hang-dump-negative", _tr("lm", "observability.hang_dump_s=-1"), "hang_dump_s", ""),
    ("mlflow-experiment-empty", _tr("lm", "observability.mlflow_experiment="), "mlflow_experiment", ""),
    # -- moe
    ("moe-every-beyond-layers", _tr("lm", "moe.experts=2", "moe.every=99"), "moe.every=99 exceeds model.n_layers", ""),
    ("moe-every-3", _tr("lm", "moe.experts=4", "moe.top_k=1", "moe.every=3"), "set moe.every <= 2", ""),
    ("moe-every-0", _tr("lm", "moe.experts=2", "moe.every=0"), "'moe.every'", ""),
    ("moe-top-k-above-experts", _tr("lm", "moe.experts=2", "moe.top_k=3"), "exceeds moe.experts=2", ""),
    ("moe-experts-negative", _tr("lm", "moe.experts=-1"), "'moe.experts'", ""),
    ("moe-capacity-negative", _tr("lm", "moe.experts=2", "moe.capacity_factor=-1"), "'moe.capacity_factor'", ""),
    ("moe-unknown-key", _tr("lm", "moe.num_experts=2"), "unknown config key 'moe.num_experts'", ""),
    # -- training that diverges: the message names the lr when checkpoints are on but none was reached
    ("lr-1e9-before-first-checkpoint", _tr("lm", "optim.lr=1e9", "checkpoint.every=5", "train.steps=8",
                                           "fault.max_consecutive_nonfinite=1"),
     "lower optim.lr (now 1e+09); it diverged before the first checkpoint (checkpoint.every=5)", RUNS),
    ("data-too-small", _tr("lm", "data.path={w}/tokens.bin", "data.val_fraction=0"), "fewer than train.batch_size=4",
     ""),
    ("data-too-small-to-hold-out", _tr("lm", "data.path={w}/tokens.bin"), "too small to hold one out: set "
     "data.val_fraction=0", ""),
    ("val-split-too-short", _tr("lm", "data.path={w}/tokens.bin", "train.seq_len=4"), "raise data.val_fraction to", ""),
    ("data-vocab-mismatch", _tr("lm", "data.path={w}/big_vocab.bin", "data.val_fraction=0"), "vocab", ""),
    # -- data prepare
    ("prepare-not-parquet", ["data", "prepare", "{w}/text.parquet", "--out", "{w}/p.bin"], "is not a Parquet file", ""),
    ("prepare-int-column", ["data", "prepare", "{w}/ints.parquet", "--out", "{w}/p.bin"], "holds int64, not", ""),
    ("prepare-no-column", ["data", "prepare", "{w}/ints.parquet", "--out", "{w}/p.bin", "--text-field", "body"],
     "has no column 'body'", ""),
    ("prepare-tokenizer-shape", ["data", "prepare", "{w}/text.txt", "--tokenizer", "{w}/tok_shape", "--out",
                                 "{w}/p.bin"], "is not a Hugging Face tokenizer.json", ""),
    ("prepare-tokenizer-vocab-list", ["data", "prepare", "{w}/text.txt", "--tokenizer", "{w}/tok_list", "--out",
                                      "{w}/p.bin"], "tokenizer.json", ""),
    ("prepare-tokenizer-not-json", ["data", "prepare", "{w}/text.txt", "--tokenizer", "{w}/tok_junk", "--out",
                                    "{w}/p.bin"], "is not valid JSON", ""),
    ("prepare-tokenizer-missing", ["data", "prepare", "{w}/text.txt", "--tokenizer", "{w}/emptydir", "--out",
                                   "{w}/p.bin"], "has no tokenizer.json", ""),
    ("prepare-out-folder", ["data", "prepare", "{w}/text.txt", "--out", "{w}/emptydir"], "is a folder", ""),
    ("prepare-out-folder-no-input", ["data", "prepare", "--out", "{w}"], "is a folder", ""),
    ("prepare-empty-file", ["data", "prepare", "{w}/empty.jsonl", "--out", "{w}/p.bin"], "is empty", ""),
    ("prepare-blank-jsonl", ["data", "prepare", "{w}/blank.jsonl", "--out", "{w}/p.bin"], "hold no text", ""),
    ("prepare-empty-texts", ["data", "prepare", "{w}/empty_texts.jsonl", "--out", "{w}/p.bin"], "hold no text", ""),
    ("prepare-jsonl-int", ["data", "prepare", "{w}/int_text.jsonl", "--out", "{w}/p.bin"], "is int, not a string", ""),
    ("prepare-jsonl-no-field", ["data", "prepare", "{w}/pairs.jsonl", "--out", "{w}/p.bin"], "has no 'text' field", ""),
    ("prepare-jsonl-not-json", ["data", "prepare", "{w}/text.jsonl", "--out", "{w}/p.bin"], "is not JSON", ""),
    ("prepare-over-existing-empty", ["data", "prepare", "{w}/blank.jsonl", "--out", "{w}/tokens.bin"],
     "nothing written", ""),
    ("tokenizer-train-vocab-small", ["tokenizer", "train", "{w}/text.txt", "--vocab-size", "10", "--out",
                                     "{w}/tk"], "vocab", ""),
    ("train-tokenizer-shape", _tr("lm", "data.tokenizer={w}/tok_shape", "data.path={w}/tokens.bin"),
     "is not a Hugging Face tokenizer.json", ""),
    ("sft-tokenizer-shape", _tr("sft", "data.tokenizer={w}/tok_shape", "data.path={w}/pairs.jsonl"),
     "is not a Hugging Face tokenizer.json", ""),
]

#: output files a refused command must not leave behind
OUTPUTS = ("p.bin", "o.onnx", "b.onnx", "rep", "tk", "runs")


def _write_hf(folder: Path, config: object, files: dict[str, bytes]) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for name, data in files.items():
        (folder / name).write_bytes(data)


def _bad_files(w: Path, run: Path) -> None:
    from safetensors.torch import save_file

    import crosstrain.data.tokenfile as tf

    save_file({"x": __import__("torch").zeros(64, 64)}, str(w / "other.safetensors"))
    good = (w / "other.safetensors").read_bytes()
    (w / "trunc.safetensors").write_bytes(good[: len(good) // 2])
    (w / "garbage.safetensors").write_bytes(bytes(range(256)) * 3)
    (w / "empty.safetensors").write_bytes(b"")
    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 64,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    _write_hf(w / "hf_garbage", llama, {"model.safetensors": bytes(range(256)) * 2})
    _write_hf(w / "hf_trunc", llama, {"model.safetensors": good[: len(good) // 2]})
    _write_hf(w / "hf_broken", "{not json", {"model.safetensors": good})
    _write_hf(w / "hf_no_type", {"hidden_size": 64}, {})
    _write_hf(w / "hf_bin", llama, {"pytorch_model.bin": b"pickle"})
    _write_hf(w / "hf_index", llama, {"model.safetensors.index.json": json.dumps(
        {"weight_map": {"x": "model-00001-of-00002.safetensors"}}).encode()})
    _write_hf(w / "hf_index_bad", llama, {"model.safetensors.index.json": b"[1, 2"})
    (w / "emptydir").mkdir()
    rows = {
        "latin1.jsonl": b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b", "completion": "c"}\n',
        "junk.jsonl": bytes(range(1, 256)) + b"\n",
        "text.jsonl": b"hello world\n",
        "no_rejected.jsonl": b'{"prompt": "p", "chosen": "a"}\n',
        "int_chosen.jsonl": b'{"prompt": "p", "chosen": 3, "rejected": "b"}\n',
        "list_row.jsonl": b"[1, 2]\n",
        "bad_role.jsonl": b'{"messages": [{"role": "robot", "content": "x"}]}\n',
        "empty_messages.jsonl": b'{"messages": []}\n',
        "empty.jsonl": b"",
        "blank.jsonl": b"\n\n  \n",
        "empty_texts.jsonl": b'{"text": ""}\n{"text": ""}\n',
        "int_text.jsonl": b'{"text": 7}\n',
        "no_prompt.jsonl": b'{"question": "q"}\n',
    }
    for name, data in rows.items():
        (w / name).write_bytes(data)
    (w / "ties.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}", "chosen": "same", "rejected": "same"})
                                          + "\n" for i in range(40)))
    (w / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}", "chosen": "YES", "rejected": "no"})
                                           + "\n" for i in range(40)))
    (w / "one_tie.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}", "chosen": "YES" if i else "same",
                                                         "rejected": "no" if i else "same"}) + "\n" for i in range(40)))
    (w / "text.txt").write_text("hello world\n")
    (w / "text.parquet").write_text("hello, not parquet\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2, 3]}), w / "ints.parquet")
    tf.write_token_file(w / "tokens.bin", [np.arange(40, dtype=np.uint8)], 256)  # too short, no manifest
    tf.write_token_file(w / "big_vocab.bin", [np.arange(0, 999, 3, dtype=np.uint16)], 1000)
    for name, doc in (("tok_shape", '{"a": 1}'), ("tok_list", '{"model": {"vocab": 5}}'), ("tok_junk", "{x")):
        (w / name).mkdir()
        (w / name / "tokenizer.json").write_text(doc)
    (w / "bi_rewards.py").write_text(
        "def boom(completions, prompts):\n    raise RuntimeError('kaboom\\nsecond line')\n\n"
        "def one(completions, prompts):\n    return [1.0]\n\n"
        "def nan(completions, prompts):\n    return [float('nan')] * len(completions)\n")


def _sha(path: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    """One finished tiny run, copies with a garbage / a dangling best pointer and an empty metrics file, bad files,
    and a port another process holds."""
    w = tmp_path_factory.mktemp("bad-plugin-inputs")
    run = w / "run"
    assert crosstrain_main(["train", *T, "--run-dir", str(run)]) == 0
    for name in ("bestbad", "bestgone", "emptymetrics", "corrupt"):
        shutil.copytree(run, w / name)
    shard = w / "corrupt" / "checkpoints" / "step_2" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum tells
    shard.write_bytes(bytes(data))
    (w / "bestbad" / "checkpoints" / "best").write_bytes(b"\xff\xfe\x00 not a step")
    (w / "bestgone" / "checkpoints" / "best").write_text("step_99\n")
    (w / "emptymetrics" / "metrics.jsonl").write_text("")
    _bad_files(w, run)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    sys.path.insert(0, str(w))
    kept = {p.name: snapshot(p) for p in (run, w / "bestbad", w / "bestgone", w / "emptymetrics", w / "corrupt")}
    kept["tokens.bin"] = _sha(w / "tokens.bin")
    try:
        yield w, kept, busy.getsockname()[1]
    finally:
        sys.path.remove(str(w))
        busy.close()


@pytest.mark.parametrize("name, argv, needle, flags", CASES, ids=[c[0] for c in CASES])
def test_bad_plugin_input_gets_one_line(world, capsys, name, argv, needle, flags) -> None:
    w, kept, port = world
    out_dir = w / "runs"
    args = [a.format(w=w, run=w / "run", bad=w / "bestbad", bestbad=w / "bestbad", bestgone=w / "bestgone",
                     emptymetrics=w / "emptymetrics", corrupt=w / "corrupt", port=port) for a in argv]
    if args[0] == "train" and "--run-dir" not in args:
        args += ["--set", f"train.output_dir={out_dir}"]
    try:
        code = crosstrain_main(args)
        captured = capsys.readouterr()
        assert code != 0, (code, captured.out, captured.err)
        err = one_line_error(captured.out, captured.err)
        assert needle in err[-1], (needle, err)
        if flags != RUNS:
            leftovers = [n for n in OUTPUTS if (w / n).exists()]
            assert not leftovers, f"{name} wrote {leftovers}"
        for folder, before in kept.items():
            now = _sha(w / folder) if folder == "tokens.bin" else snapshot(w / folder)
            assert now == before, f"{name} changed {folder}"
    finally:
        for n in OUTPUTS:
            shutil.rmtree(w / n, ignore_errors=True) if (w / n).is_dir() else (w / n).unlink(missing_ok=True)


def test_real_processes_print_warnings_as_one_line(world) -> None:
    """In a real process (pytest captures warnings in this one) a warning before an error is one line too."""
    w, _, _ = world
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # 1 of 40 pairs tied (a warning), then an eval batch the held-out rows cannot fill (the error)
    cases = [[*_tr("dpo", f"data.path={w}/one_tie.jsonl", "eval.every=1", "eval.batch_size=4000"), "--set",
              f"train.output_dir={w}/runs"]]
    procs = [subprocess.Popen([sys.executable, "-m", "crosstrain", *argv], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for argv in cases]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err
        assert one_line_error(out, err, lines=2)[0].startswith("crosstrain: warning: 1 of "), err
    assert not (w / "runs").exists()


def test_reward_fn_traceback_is_logged_for_verbose(world, capsys, caplog) -> None:
    """The one line names the function and the step; the user's traceback goes to the INFO log, which
    ``crosstrain -v`` prints (the catalogue above checks that stderr has none without it)."""
    w, _, _ = world
    argv = [*_tr("grpo", "reward.fn=bi_rewards:boom"), "--set", f"train.output_dir={w}/runs"]
    caplog.set_level("INFO", logger="crosstrain.plugins.rlhf.rl.tasks")
    try:
        assert crosstrain_main(["-v", *argv]) == 2
    finally:
        shutil.rmtree(w / "runs", ignore_errors=True)
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "crosstrain: error: reward.fn bi_rewards:boom raised RuntimeError: kaboom at step 1")
    logged = [r for r in caplog.records if r.exc_info and "bi_rewards:boom" in r.getMessage()]
    assert logged and "kaboom" in str(logged[0].exc_info[1])


def test_plugin_catalogue_is_large_enough() -> None:
    assert len(CASES) >= 130 and len({c[0] for c in CASES}) == len(CASES)


def test_dpo_warns_once_about_some_ties(tmp_path, capsys) -> None:
    """Some pairs with chosen == rejected train (the others teach), with one warning line that counts them."""
    rows = [{"prompt": f"p{i}", "chosen": "same" if i < 3 else "YES", "rejected": "same" if i < 3 else "no"}
            for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match=r"3 of \d+ training pairs .* have chosen == rejected"):
        from crosstrain.config import load_config
        from crosstrain.plugins.rlhf.recipes import RECIPES

        config = load_config(None, [f"data.path={tmp_path / 'd.jsonl'}", "train.recipe=dpo", "train.seq_len=32",
                                    "data.val_fraction=0.1"])
        RECIPES["dpo"]().validate(config)


def _records(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_a_run_killed_before_its_first_checkpoint_restarts_without_duplicate_steps(tmp_path) -> None:
    """SIGKILL after two logged steps (no checkpoint yet), then the same command again: every step once in
    metrics.jsonl and in the rank file (the dead attempt's records are dropped by the fresh start)."""
    run = tmp_path / "run"
    argv = ["train", *SMALL, "--set", "backend=cpu", "--set", "train.steps=4", "--set", "checkpoint.every=100",
            "--set", "eval.every=0", "--run-dir", str(run)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    # a slow step gives the poll time to see two records before the run ends
    proc = subprocess.Popen([sys.executable, "-m", "crosstrain", *argv, "--set", "train.batch_size=64"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = run / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and len(_records(metrics)) >= 2):
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (run / "checkpoints" / "step_4").exists(), "the run finished before it could be killed"
    assert len(_records(metrics)) >= 2
    assert crosstrain_main(argv) == 0
    assert _records(metrics) == [1, 2, 3, 4]
    assert _records(run / "ranks" / "metrics.rank0.jsonl") == [1, 2, 3, 4]


def test_file_size_limit_is_named_and_turns_compile_off(tmp_path) -> None:
    """Under ``ulimit -f`` (RLIMIT_FSIZE) auto compile stays off, a forced one is one ConfigError, and a failed
    checkpoint write names the limit, not a full disk (the disk has room)."""
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))\n"
        "from crosstrain.engine.fast_defaults import decide_compile\n"
        "from crosstrain.checkpoint.space import no_space\n"
        "from crosstrain.errors import ConfigError\n"
        "print(decide_compile('auto', None, True, 10**6, 10.0, 'k').reason)\n"
        "try:\n    decide_compile(True, None, True, 10, 1.0, 'k')\nexcept ConfigError as e:\n    print('refused', e)\n"
        f"print(no_space({str(tmp_path)!r}, 2 << 20))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stderr
    assert lines[0] == "a file-size limit (ulimit -f, 1 MB) stops the C++ compiler"
    assert lines[1].startswith("refused parallel.compile=True cannot compile under a file-size limit of 1 MB")
    assert lines[2].startswith(f"a file-size limit (ulimit -f, 1.05 MB) stopped a checkpoint write at {tmp_path}")
