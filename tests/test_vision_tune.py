"""``crosstrain tune`` over ``--recipe classify`` keys (the learning rate, label smoothing, MixUp): a 2-trial study end
to end, maximising the held-out top-1 the recipe evaluates; each trial's run holds the sampled values, its
objective is its last ``eval/top1`` and its intermediate values are its ``eval/top1`` at each evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from in_process import crosstrain_main

pytest.importorskip("sklearn")
optuna = pytest.importorskip("optuna")
try:
    from crosstrain.plugins.vision.tv import torchvision

    torchvision()
except ImportError:
    pytest.skip("needs the vision extra (torchvision, timm)", allow_module_level=True)

SPACE = """
[tune]
metric = "eval_top1"
direction = "maximize"
pruner = "none"
sampler = "random"

[space]
"optim.lr" = { low = 1e-3, high = 1e-2, log = true }
"classify.label_smoothing" = { choices = [0.0, 0.1] }
"vision.mixup_alpha" = { choices = [0.0, 0.2] }
"""


def _evals(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval/top1"]) for r in rows if "eval/top1" in r]


def test_tune_classify_maximises_held_out_top1(tmp_path, capsys) -> None:
    import tomllib

    space = tmp_path / "digits.toml"
    space.write_text(SPACE)
    out = tmp_path / "out"
    sets = ["train.recipe=classify", "train.steps=20", "eval.every=10", "eval.max_batches=0", "checkpoint.every=0",
            "checkpoint.final=false", "backend=cpu", "logging.progress=none"]
    argv = ["tune", str(space), "--trials", "2", "--out", str(out), "--json"]
    for s in sets:
        argv += ["--set", s]
    capsys.readouterr()
    assert crosstrain_main(argv) == 0
    found = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert found["complete"] == 2 and found["failed"] == 0
    study = optuna.load_study(study_name=found["study"], storage=found["storage"])
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE
    runs = sorted((out / "digits").glob("trial_*"))
    assert len(runs) == len(study.trials) == 2
    for trial, run in zip(sorted(study.trials, key=lambda t: t.number), runs, strict=True):
        evals = _evals(run)
        assert [s for s, _ in evals] == [10, 20]
        assert trial.value == pytest.approx(evals[-1][1], abs=1e-9)  # the objective: the held-out top-1
        assert trial.intermediate_values == pytest.approx(dict(evals), abs=1e-9)
        config = tomllib.loads((run / "config.toml").read_text())
        assert config["train"]["recipe"] == "classify"
        assert config["optim"]["lr"] == pytest.approx(trial.params["optim.lr"])
        assert config["classify"]["label_smoothing"] == trial.params["classify.label_smoothing"]
        assert config["vision"]["mixup_alpha"] == trial.params["vision.mixup_alpha"]
        assert 0.0 <= trial.value <= 1.0
    assert found["best_value"] == pytest.approx(max(t.value for t in study.trials), abs=1e-9)
    assert found["best_params"] == study.best_params
