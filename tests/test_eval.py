"""Validation: the held-out split, periodic evaluation that leaves training untouched, `crosstrain eval` under
several layouts, and keep-best retention."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import shared_ranks
import torch

from crosstrain import hookimpl
from crosstrain.config import load_config
from crosstrain.data.corpus import corpus_bytes
from crosstrain.data.split import corpus_document_starts, separator_document_starts, split_tokens
from crosstrain.engine import Trainer
from crosstrain.errors import ConfigError

SMALL = ["train.steps=6", "train.batch_size=4", "train.seq_len=32", "logging.progress=none", "backend=cpu",
         "schedule.warmup_steps=0", "model.n_layers=2", "model.dim=32", "model.n_heads=2",
         "data.val_fraction=0.05", "eval.max_batches=4"]


def _config(tmp_path, *extra: str):
    return load_config(None, [*SMALL, f"train.output_dir={tmp_path / 'runs'}", *extra])


def test_split_holds_the_fraction_of_tokens_at_a_chapter_boundary() -> None:
    text = corpus_bytes()
    starts = corpus_document_starts(text)
    assert len(starts) == 80 and starts[0] == 0
    tokens = np.frombuffer(text, dtype=np.uint8)
    split = split_tokens(tokens, starts, 0.05)
    assert split.val is not None and len(split.train) + len(split.val) == len(tokens)
    # a chapter boundary lies within 10% of the 5% asked, so the cut moves to it and no chapter is split
    assert abs(len(split.val) - 0.05 * len(tokens)) <= 0.1 * 0.05 * len(tokens) + 1
    assert bytes(split.val[:8]) == b"Chapter " and int(split.info["split_at_token"]) in set(starts.tolist())
    assert not split.info["document_split"] and split.info["val_documents"] == 3
    assert split_tokens(tokens, starts, 0.05).info == split.info  # deterministic
    stream = np.array([5, 6, 0, 7, 0, 8, 9, 9], dtype=np.int64)  # EOS = 0 closes documents
    assert separator_document_starts(stream, 0).tolist() == [0, 3, 5]
    assert split_tokens(stream, separator_document_starts(stream, 0), 0.3).val.tolist() == [8, 9, 9]


def test_eval_on_or_off_trains_the_same_weights(tmp_path) -> None:
    on = Trainer(_config(tmp_path, "eval.every=2"), run_dir=tmp_path / "on").fit()
    off = Trainer(_config(tmp_path, "eval.every=0"), run_dir=tmp_path / "off").fit()
    assert on["params_sha256"] == off["params_sha256"] and on["losses"] == off["losses"]
    records = [json.loads(x) for x in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/loss" in r] == [2, 4, 6]
    for r in records:
        if "eval/loss" in r:
            assert r["eval/perplexity"] == pytest.approx(math.exp(r["eval/loss"])) and r["time_eval_s"] > 0
    assert math.isfinite(on["eval_loss"]) and on["best_eval_loss"] <= on["eval_loss"]
    assert off["eval_loss"] is None or not math.isfinite(off["eval_loss"])
    split = json.loads((tmp_path / "on" / "data_split.json").read_text())
    assert split["val_documents"] == 3 and split["source"] == "embedded corpus"
    from crosstrain.engine.evaluate import check_eval

    with pytest.raises(ConfigError, match=r"eval.batch_size=3 must be divisible by the data-parallel degree \(2\)"):
        check_eval(100, 3, 2, 1)
    with pytest.raises(ConfigError, match="fewer than eval.batch_size=8"):
        check_eval(5, 8, 1, 1)
    with pytest.raises(ConfigError, match="fewer than eval.batch_size"):  # before any file is written
        Trainer(_config(tmp_path, "eval.batch_size=4000", "eval.every=2"), run_dir=tmp_path / "big").fit()
    assert not (tmp_path / "big").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "crosstrain", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def _eval_layouts(collective, run: str, layouts: list[str]) -> dict[str, dict]:
    """``crosstrain eval``'s own function under each layout in turn, on the shared 2 ranks."""
    from crosstrain.checkpoint.resolve import resolve_path
    from crosstrain.engine.evaluate_checkpoint import evaluate_checkpoint

    source = resolve_path(run, accept=("checkpoint",))
    assert source.run_dir is not None
    return {layout: evaluate_checkpoint(load_config(source.run_dir / "config.toml", [layout]), source.path)
            for layout in layouts}


def test_crosstrain_eval_matches_the_run_under_every_layout(tmp_path, capsys) -> None:
    from crosstrain.cli.main import main

    run = tmp_path / "run"
    summary = Trainer(_config(tmp_path, "eval.every=3", "checkpoint.every=6"), run_dir=run).fit()
    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0  # in this process, as the CLI runs it
    one = capsys.readouterr()
    result = json.loads(one.out.strip().splitlines()[-1])
    assert result["step"] == 6 and abs(result["loss"] - summary["eval_loss"]) <= 1e-6
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))  # lm's loss is a token NLL
    # the CLI's --nproc launch once; every other layout through the same function on the shared 2 ranks
    proc = _cli("eval", str(run), "--json", "--nproc", "2", "--set", "parallel.dp_shard=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    others = {"parallel.dp_shard=2": json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])}
    layouts = ["parallel.tp=2", "parallel.pp=2", "parallel.dp_replicate=2"]
    rank0, rank1 = shared_ranks.run(_eval_layouts, str(run), layouts, timeout=300)
    assert [rank0[x]["rank"] for x in layouts] == [0] * 3 and [rank1[x]["rank"] for x in layouts] == [1] * 3
    others.update(rank0)
    for layout, other in others.items():
        assert other["world_size"] == 2, layout
        assert abs(other["loss"] - result["loss"]) <= 1e-5 * result["loss"], layout
        if layout in rank1:
            assert rank1[layout]["loss"] == other["loss"], layout  # every rank has the figures
    assert main(["eval", str(tmp_path / "nope")]) == 2
    bad = capsys.readouterr().err
    assert "does not exist" in bad and "Traceback" not in bad


class _Spoil:
    """Adds large noise to every parameter after step 3, so later evaluations are worse than step 2's."""

    @hookimpl
    def crosstrain_after_optimizer_step(self, context, step):
        if step == 3:
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in context.models["model"].parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 3.0)


def test_keep_best_survives_worse_saves(tmp_path, plugin) -> None:
    plugin(_Spoil(), "spoil")
    run = tmp_path / "run"
    summary = Trainer(_config(tmp_path, "eval.every=100", "checkpoint.every=2", "checkpoint.keep_last=1",
                              "checkpoint.keep_best=true"), run_dir=run).fit()
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/loss"] for r in records if "eval/loss" in r}
    assert sorted(evals) == [2, 4, 6] and evals[2] < min(evals[4], evals[6])  # evaluated at every save
    assert summary["best_eval_step"] == 2 and summary["best_eval_loss"] == evals[2]
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_2", "step_6"]
    assert (ckpts / "best").read_text().strip() == "step_2"
    best = _cli("eval", str(run), "--best", "--json")
    assert best.returncode == 0, best.stderr
    assert json.loads(best.stdout.strip().splitlines()[-1])["loss"] == pytest.approx(evals[2], abs=1e-6)
    from crosstrain.plugins.export.loading import load_model

    assert load_model(run, best=True).source.endswith("step_2")
