"""TensorBoard: where its package is installed a run writes event files holding metrics.jsonl's values; where it
cannot be imported (a real interpreter whose import system refuses it) the run trains the same, writes no
tensorboard/ and prints no warning about it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from in_process import crosstrain_main

TINY = ["backend=cpu", "model.n_layers=1", "model.dim=32", "model.n_heads=2", "train.seq_len=32",
        "train.batch_size=4", "train.steps=4", "eval.every=0", "logging.progress=none", "logging.tensorboard=true",
        "schedule.warmup_steps=0", "parallel.compile=false", "checkpoint.every=0", "checkpoint.final=false"]

# a finder ahead of every other that refuses tensorboard: what an environment without the package sees
BLOCK = textwrap.dedent("""
    import sys
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name == "tensorboard" or name.startswith("tensorboard."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, Refuse())
""")


def _args(run_dir: Path) -> list[str]:
    return ["train", "--run-dir", str(run_dir), *(f"--set={s}" for s in TINY)]


def _train_without_tensorboard(run_dir: Path) -> subprocess.CompletedProcess:
    code = (BLOCK + "try:\n    import tensorboard\nexcept ModuleNotFoundError:\n    pass\n"
            "else:\n    raise SystemExit('tensorboard was not blocked')\n"
            f"from crosstrain.cli.main import main\nsys.exit(main({_args(run_dir)!r}))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def test_tensorboard_writes_where_installed_and_is_silent_where_not(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason='the tensorboard extra: pip install "crosstrain[tensorboard]"')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert crosstrain_main(_args(tmp_path / "tb")) == 0
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("loss")}
    assert logged == pytest.approx(_losses(tmp_path / "tb"), rel=1e-6) and len(logged) == 4

    without = _train_without_tensorboard(tmp_path / "none")
    assert without.returncode == 0, without.stderr[-2000:]
    assert not (tmp_path / "none" / "tensorboard").exists()
    assert "tensorboard" not in without.stderr.lower() and "warning" not in without.stderr.lower(), without.stderr
    assert _losses(tmp_path / "none") == _losses(tmp_path / "tb")  # the same training either way
