"""``parallel.compile = "auto"`` compiles only when it pays (issue 41): the decision weighs the recorded (or
default) compile cost against the steps x per-step saving, and summary.json records both and the choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crosstrain.config import load_config
from crosstrain.engine import fast_defaults
from crosstrain.engine.fast_defaults import COLD_COMPILE_S, EXPECTED_GAIN, compile_pays
from crosstrain.engine.trainer import Trainer
from crosstrain.parallel.dims import ParallelDims

TINY = ["train.batch_size=4", "train.seq_len=32", "logging.progress=none", "logging.tensorboard=false",
        "backend=cpu", "schedule.warmup_steps=2", "eval.every=0", "model.dim=32", "model.n_layers=1",
        "model.n_heads=2", "observability.per_rank=false", "parallel.compile=auto"]


def test_compile_pays_hand_computed() -> None:
    # no record: a cold compile (40 s) against 15% of the estimated step
    cost, saving, how = compile_pays(50, None, 0.2)
    assert (cost, saving) == (COLD_COMPILE_S, pytest.approx(50 * 0.2 * EXPECTED_GAIN))  # 40 s vs 1.5 s
    assert "cold default" in how
    assert compile_pays(2000, None, 0.2)[1] == pytest.approx(60.0)  # 2000 x 0.03 s = 60 s > 40 s
    # a warm compile measured at 12 s; eager 0.30 s vs compiled 0.20 s a step: 0.1 s saved a step
    warm = {"compile_s": 12.0, "eager_step_s": 0.30, "compiled_step_s": 0.20}
    assert compile_pays(50, warm, 9.9)[:2] == (12.0, pytest.approx(5.0))  # 50 x 0.1 = 5 s < 12 s: eager
    assert compile_pays(200, warm, 9.9)[:2] == (12.0, pytest.approx(20.0))  # 20 s > 12 s: compile
    # compiled slower than eager: no saving at all, whatever the length
    assert compile_pays(10**6, {"compile_s": 1.0, "eager_step_s": 0.1, "compiled_step_s": 0.2}, 1.0)[1] == 0.0
    # only the eager step known: 15% of it
    assert compile_pays(100, {"eager_step_s": 0.4}, 9.9)[:2] == (COLD_COMPILE_S, pytest.approx(6.0))


def test_decide_compile_follows_compile_pays(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    one = ParallelDims()
    fast_defaults.write_record("k", compile_s=12.0, eager_step_s=0.30, compiled_step_s=0.20)
    short = fast_defaults.decide_compile("auto", one, True, 50, 0.0, "k")
    long = fast_defaults.decide_compile("auto", one, True, 200, 0.0, "k")
    assert (short.decision, short.estimate_s, short.saving_s) == ("eager", 12.0, pytest.approx(5.0))
    assert (long.decision, long.estimate_s, long.saving_s) == ("compile", 12.0, pytest.approx(20.0))
    assert "parallel.compile=true forces it" in short.reason


def test_50_step_run_with_a_warm_record_stays_eager_and_says_why(tmp_path: Path, monkeypatch) -> None:
    """A first 50-step run records its eager step time; the record then gets a warm compile measured at 5 s that
    saves 10% a step: a second 50-step run does not compile (50 x 10% of a millisecond step << 5 s), and
    summary.json carries the figures weighed, equal to the record's arithmetic."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    sets = [*TINY, "train.steps=50", f"train.output_dir={tmp_path}"]
    first = Trainer(load_config(None, sets), run_dir=tmp_path / "first").fit()
    assert first["compile_decision"] == "eager" and first["compile_s"] == 0.0
    assert first["compile_estimate_s"] == COLD_COMPILE_S
    (record_file,) = (tmp_path / "cache" / "crosstrain" / "compile").glob("*.json")
    record = json.loads(record_file.read_text())
    eager = record["eager_step_s"]
    assert eager > 0
    key = record_file.stem
    fast_defaults.write_record(key, compile_s=5.0, compiled_step_s=0.9 * eager)
    second = Trainer(load_config(None, sets), run_dir=tmp_path / "second").fit()
    written = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert written["compile_decision"] == "eager" and written["compile_s"] == 0.0
    assert written["compile_estimate_s"] == 5.0
    assert written["compile_saving_s"] == pytest.approx(50 * 0.1 * eager, rel=1e-6)
    assert written["defaults"]["compile"]["enabled"] is False
    assert "vs compile 5.0 s (measured)" in written["defaults"]["compile"]["reason"]
    assert second["compile_saving_s"] < second["compile_estimate_s"]


def test_a_resumed_run_weighs_the_steps_left_not_train_steps(tmp_path: Path, monkeypatch) -> None:
    """Resumed at step 150 of 200, a run weighs 50 steps: with a record where compiling pays after 100 steps (cost
    100 eager steps, saving a whole eager step each), the resumed run stays eager, though a fresh 200-step run on
    the same record compiles."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    run = tmp_path / "run"
    sets = [*TINY, f"train.output_dir={tmp_path}", "checkpoint.every=0"]
    Trainer(load_config(None, [*sets, "train.steps=150"]), run_dir=run).fit()  # its final checkpoint: step 150
    (record_file,) = (tmp_path / "cache" / "crosstrain" / "compile").glob("*.json")
    eager = json.loads(record_file.read_text())["eager_step_s"]
    fast_defaults.write_record(record_file.stem, compile_s=100 * eager, compiled_step_s=0.0)
    assert fast_defaults.decide_compile("auto", ParallelDims(), True, 200, 0.0, record_file.stem).enabled
    resumed = Trainer(load_config(None, [*sets, "train.steps=200"]), run_dir=run).fit()
    assert resumed["steps_this_run"] == 50
    assert resumed["compile_decision"] == "eager" and resumed["compile_s"] == 0.0
    assert resumed["compile_estimate_s"] == pytest.approx(100 * eager)
    assert resumed["compile_saving_s"] == pytest.approx(50 * eager)
    assert "(50 steps x" in resumed["defaults"]["compile"]["reason"]
