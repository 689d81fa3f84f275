"""Figures that do not mislead (issue 41): MFU counts the FLOPs a LoRA run performs, tokens/s counts real tokens
and leaves out the first (compiling, warming) step, layouts are named by what runs, the progress line shows the
last eval loss and the recipe's headline metrics, and a tokenizer smaller than asked says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crosstrain.config import load_config
from crosstrain.data import DistributedBatchSampler
from crosstrain.engine.flops import count_flops
from crosstrain.engine.metrics import PlainConsoleSink, format_line
from crosstrain.engine.trainer import Trainer
from crosstrain.models.gpt import build_gpt
from crosstrain.plugins.rlhf.lora import add_lora

RLHF = ["model.n_layers=2", "model.dim=32", "model.n_heads=2", "train.batch_size=4", "train.steps=8",
        "rlhf.max_length=64", "rlhf.max_prompt_length=48", "rlhf.max_new_tokens=4", "eval.every=0",
        "logging.progress=none", "logging.every=1", "backend=cpu", "optim.lr=1e-2", "schedule.warmup_steps=2",
        "parallel.compile=false", "logging.tensorboard=false"]


def lora_flops_by_hand(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of a GPT whose base is frozen and whose LoRA adapters train.

    Per weight matrix with ``n`` parameters a token costs ``2n`` forward (one multiply-add per weight) and ``4n``
    backward: ``2n`` for the input gradient and ``2n`` for the weight gradient (Kaplan et al. 2020, sec. 2.1; PaLM,
    Chowdhery et al. 2022, appendix B: 6N). A frozen base weight computes no weight gradient, but the input
    gradient still flows through it to the adapters of the layers below, so it costs ``2n + 2n = 4n``; an adapter
    weight trains and costs ``6n``. Attention (no weights) keeps PaLM's ``12 L d T`` (forward ``4 L d T``, both
    backward matmuls are activation gradients). The input embedding is a lookup: no matmul, left out as in 6N.
    """
    base = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n and n != "tok_embeddings.weight")
    adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    cfg = model.config
    return 4 * base + 6 * adapter + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def test_lora_flops_are_the_frozen_base_plus_the_adapters() -> None:
    model = build_gpt("tiny", n_layers=2, dim=32, n_heads=2)
    full, _ = count_flops([("policy", model, True)], 64)
    add_lora(model, rank=4, alpha=8, dropout=0.0, targets=["wq", "wk", "wv", "wo", "w1", "w2", "w3"])
    lora, record = count_flops([("policy", model, True)], 64)
    assert lora == lora_flops_by_hand(model, 64)
    assert lora < full + 6 * sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert "frozen parameters (no weight gradient)" in record["policy"]["counted"]


def test_lora_sft_counts_real_tokens_and_true_flops(tmp_path: Path) -> None:
    """SFT with varied completion lengths under LoRA: every step's tokens are the non-pad tokens counted by hand
    from the sampler's rows, the summary's tokens/s is the live rate of the step records (first step left out),
    and MFU is the hand-derived FLOP count x tokens/s / peak, at most 100%."""
    data = tmp_path / "sft.jsonl"  # completions of 1 to 40 characters: every batch is padded differently
    data.write_text("".join(json.dumps({"prompt": f"Q{i}: say it", "completion": "ab" * (1 + (i * 7) % 20)}) + "\n"
                            for i in range(80)))
    config = load_config(None, [*RLHF, "train.recipe=sft", "lora.rank=4", "rlhf.max_length=64",
                                f"data.path={data}"])
    trainer = Trainer(config, run_dir=tmp_path / "sft")
    summary = trainer.fit()
    records = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    rows = trainer.built.dataset.rows
    sampler = DistributedBatchSampler(len(rows), config.train.batch_size, seed=config.train.seed,
                                      shuffle=config.data.shuffle)
    padded_any = False
    for rec in records:
        seqs = [rows[int(i)] for idx in sampler.next_step() for i in idx]
        real, width = sum(len(s.ids) for s in seqs), max(len(s.ids) for s in seqs)
        assert rec["tokens"] == real
        assert rec["padding_tokens"] == len(seqs) * width - real
        padded_any = padded_any or real < len(seqs) * width
    assert padded_any  # the run did have padding to leave out
    assert summary["tokens"] == sum(r["tokens"] for r in records)
    assert summary["padding_tokens"] == sum(r["padding_tokens"] for r in records)
    live = sum(r["tokens"] for r in records[1:]) / sum(r["step_time_s"] for r in records[1:])
    assert summary["tokens_per_s"] == pytest.approx(live, rel=0.10)
    policy = trainer.built.primary.module
    flops = lora_flops_by_hand(policy, config.train.seq_len)
    assert summary["mfu_flops"]["policy"]["flops_per_token"] == flops
    peak = summary["peak_flops"]["flops"]
    assert summary["mfu"] == pytest.approx(flops * summary["tokens_per_s"] / peak, rel=1e-9)
    assert 0 < summary["mfu"] <= 1.0
    # the served version of this LoRA run (adapters merged to serve) shows the summary's hash
    from crosstrain.plugins.serve.versions import load_version

    served = load_version(str(tmp_path / "sft"), 1, "torch", 2, tmp_path / "serve")
    assert served.params_sha256 == summary["params_sha256"]
    assert served.describe()["params_sha256"] == summary["params_sha256"]


def test_progress_line_shows_eval_loss_and_headline_metrics() -> None:
    m = {"loss": 0.6931, "lr": 1e-3, "rewards/accuracies": 0.75, "rewards/margins": 0.125, "logps/chosen": -3.0}
    line = format_line(4, 8, m, ("rewards/accuracies", "rewards/margins"), 0.5)
    assert line.startswith("step 4/8 | loss 0.6931 | eval 0.5000 | rewards/accuracies 0.7500 | "
                           "rewards/margins 0.1250 | lr 1.0e-03")
    assert "logps" not in line and "eval" not in format_line(1, 8, m)


def test_dpo_progress_line_carries_its_declared_metrics(tmp_path: Path, capsys) -> None:
    """A real DPO run's plain progress lines: the recipe's declared ``rewards/accuracies`` on every line, the
    last eval loss from the first eval on (and kept on the lines after it)."""
    sets = [*RLHF, "train.recipe=dpo", "train.steps=6", "eval.every=3", "eval.steps=1", "eval.batch_size=4",
            "logging.progress=plain", "logging.every=1"]
    summary = Trainer(load_config(None, sets), run_dir=tmp_path / "dpo").fit()
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    assert len(lines) == 6 and all(" | rewards/accuracies " in x and " | rewards/margins " in x for x in lines)
    assert not any(" | eval " in x for x in lines[:2])
    records = [json.loads(x) for x in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    third = records[2]["eval/loss"]
    assert f" | eval {third:.4f} | " in lines[2] and f" | eval {third:.4f} | " in lines[3]
    assert f" | eval {summary['eval_loss']:.4f} | " in lines[5]
    assert f"rewards/accuracies {records[0]['rewards/accuracies']:.4f}" in lines[0]


def test_plain_sink_prints_on_eval_steps() -> None:
    import io

    out = io.StringIO()
    sink = PlainConsoleSink(10, 5, out, headline=())
    sink.write(2, {"loss": 1.0})
    sink.write(3, {"loss": 1.0, "eval/loss": 0.9})
    sink.write(5, {"loss": 0.8})
    lines = out.getvalue().splitlines()  # step 2 is no print step; step 3 is, for its eval
    assert [x.split(" | ")[:3] for x in lines] == [["step 3/10", "loss 1.0000", "eval 0.9000"],
                                                   ["step 5/10", "loss 0.8000", "eval 0.9000"]]


def test_pure_replication_is_named_ddp(tmp_path: Path) -> None:
    """``parallel.dp_replicate=2`` on 2 ranks runs as DDP (parallelize wraps a pure replica in DDP): the
    summary's layout says so."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "crosstrain", "train", "--run-dir", str(tmp_path / "rep"), "--nproc", "2"]
    for s in ("train.steps=2", "train.batch_size=4", "train.seq_len=32", "model.dim=32", "model.n_layers=1",
              "model.n_heads=2", "backend=cpu", "logging.progress=none", "parallel.dp_replicate=2",
              "parallel.compile=false", "eval.every=0", "logging.tensorboard=false"):
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert summary["mesh"]["dp_replicate"] == 2 and summary["defaults"]["layout"]["choice"] == "ddp"
    assert "DDP" in summary["defaults"]["layout"]["reason"]


def test_tokenizer_smaller_than_asked_says_so(tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer

    from crosstrain.data.tokenizer_train import train_bpe

    text = tmp_path / "small.txt"
    text.write_text("the cat sat on the mat\n" * 20)
    out = train_bpe([str(text)], 32000, tmp_path / "tok")
    got = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    err = capsys.readouterr().err.strip().splitlines()
    assert got < 32000
    assert err == [f"crosstrain: the tokenizer has {got} tokens, fewer than --vocab-size 32000: the corpus has "
                   "no more pairs occurring >= 2 times; give more text for a larger vocabulary"]
