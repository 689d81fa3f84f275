"""Under ``quant.qat`` every evaluation also runs in floating point (``eval/fp/loss``, the compress plugin's
``crosstrain_eval_variants``): the same checkpoint evaluated without QAT gives that value, and with QAT the plain
``eval/loss`` (the fake-quantised model's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from in_process import crosstrain_main

SETS = ["train.batch_size=4", "train.seq_len=32", "logging.progress=none", "backend=cpu", "train.steps=4",
        "eval.every=4", "eval.steps=2", "model.n_layers=1", "quant.qat=int8-act-int4-weight", "quant.group_size=32",
        "schedule.warmup_steps=0"]


def _argv(*head: str, sets: list[str]) -> list[str]:
    out = list(head)
    for s in sets:
        out += ["--set", s]
    return out


def test_qat_runs_report_the_float_eval_loss_beside_the_quantised_one(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert crosstrain_main(_argv("train", "--run-dir", str(run), sets=SETS)) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval/loss"' in x]
    final = rows[-1]
    assert {"eval/loss", "eval/fp/loss", "eval/fp/perplexity"} <= set(final)
    assert final["eval/fp/loss"] != final["eval/loss"]  # int4 weights really change the model
    capsys.readouterr()
    assert crosstrain_main(_argv("eval", str(run), "--json", sets=["quant.qat=none"])) == 0
    fp = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert fp["loss"] == pytest.approx(final["eval/fp/loss"], rel=1e-6)
    assert "eval/fp/loss" not in fp  # no QAT: no variant
    assert crosstrain_main(_argv("eval", str(run), "--json", sets=[])) == 0
    quantised = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert quantised["loss"] == pytest.approx(final["eval/loss"], rel=1e-6)
    assert quantised["eval/fp/loss"] == pytest.approx(final["eval/fp/loss"], rel=1e-6)
