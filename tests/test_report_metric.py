"""``crosstrain report RUN --metric NAME`` (repeatable): a line panel of any logged metric, one point per record
that logged it; a name no run logged is a one-line error listing the logged ones, before any file is written."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
from in_process import crosstrain_main
from one_line import one_line_error

TINY = ["backend=cpu", "model.n_layers=1", "model.dim=32", "model.n_heads=2", "train.seq_len=32",
        "train.batch_size=4", "train.steps=6", "eval.every=2", "eval.max_batches=2", "logging.progress=none",
        "logging.tensorboard=false", "schedule.warmup_steps=0", "parallel.compile=false", "checkpoint.every=0"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("metric") / "run"
    assert crosstrain_main(["train", "--run-dir", str(path), *(f"--set={s}" for s in TINY)]) == 0
    return path


def _points(page: str) -> dict[str, int]:
    return {m[0]: int(m[1]) for m in re.findall(r"<section class='panel' id='panel-([^']+)' data-points='(\d+)'",
                                                page)}


def test_metric_panels_plot_each_logged_value(run_dir: Path, tmp_path: Path, capsys) -> None:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = tmp_path / "rep"
    assert crosstrain_main(["report", str(run_dir), "--out", str(out), "--metric", "eval/perplexity",
                            "-m", "time_*"]) == 0, capsys.readouterr().err
    points = _points((out / "report.html").read_text())
    assert points["metric-eval_perplexity"] == sum("eval/perplexity" in r for r in records) == 3  # steps 2, 4, 6
    timings = {k for r in records for k in r if k.startswith("time_")}
    assert len(timings) >= 2
    assert points["metric-time"] == sum(k in r for r in records for k in timings)  # every match, one line each
    png = (out / "metric-eval_perplexity.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and base64.b64encode(png).decode() in (out / "report.html").read_text()
    assert "loss" in points and "metric-loss" not in points  # the built-in panels stay; only the asked ones are added


def test_unknown_metric_lists_the_logged_ones(run_dir: Path, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    out = tmp_path / "rep"
    assert crosstrain_main(["report", str(run_dir), "--out", str(out), "--metric", "rewards/accuracies"]) == 2
    captured = capsys.readouterr()
    (line,) = one_line_error(captured.out, captured.err, lines=1)
    assert "--metric 'rewards/accuracies' is not in the runs' metrics.jsonl; logged metrics: " in line
    assert "eval/loss" in line and "grad_norm" in line and "lr" in line
    assert not out.exists()
