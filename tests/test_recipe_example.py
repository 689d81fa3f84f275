"""The example recipe package (examples/crosstrain-recipe-example), pip-installed as a third party would:
a trainable policy and a frozen reference (KL-to-reference loss) on 2 FSDP2 ranks equal the 1-process run within
1e-5, and a run killed with SIGKILL and resumed ends with the uninterrupted run's params_sha256."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_kill import sigkill_after_checkpoint

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--recipe", "lm_kl", "--set", "train.steps=12", "--set", "train.batch_size=4", "--set", "train.seq_len=32",
        "--set", "model.n_layers=2", "--set", "model.dim=32", "--set", "model.n_heads=2", "--set", "lm_kl.beta=0.5",
        "--set", "logging.progress=plain", "--set", "logging.every=1", "--set", "backend=cpu",
        "--set", "export.safetensors=true", "--set", "optim.lr=1e-2"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("recipe-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT / "examples" / "crosstrain-recipe-example")],
                   check=True, capture_output=True, timeout=300)
    return target


def _env(site: Path) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")


def _train(site: Path, run_dir: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "crosstrain", "train", *ARGS, "--run-dir", str(run_dir), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(site), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "export" / "model.safetensors"))


def test_two_model_recipe_fsdp_matches_one_process_and_resumes_exactly(site, tmp_path) -> None:
    one = _train(site, tmp_path / "one")
    assert one["recipe"] == "lm_kl" and set(one["models"]) == {"policy", "reference"}
    assert one["models"]["reference"]["trainable"] is False and one["models"]["reference"]["source"]
    lines = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert lines[-1]["kl"] > 1e-4 and lines[-1]["loss"] == pytest.approx(lines[-1]["ce"] + 0.5 * lines[-1]["kl"])

    two = _train(site, tmp_path / "two", "--nproc", "2", "--set", "parallel.dp_shard=2")
    assert two["world_size"] == 2 and two["mesh"]["dp_shard"] == 2
    assert len(two["losses"]) == len(one["losses"]) == 12
    for a, b in zip(one["losses"], two["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a))
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert sorted(w1) == sorted(w2) and w1
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-5)

    # SIGKILL the 2-rank run once its step-6 checkpoint is committed, then run the same command again
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "crosstrain", "train", *ARGS, "--run-dir", str(run), "--nproc", "2",
           "--set", "parallel.dp_shard=2", "--set", "checkpoint.every=3"]
    sigkill_after_checkpoint(cmd, run, 6, _env(site), timeout_s=300, poll_s=0.05)
    resumed = _train(site, run, "--nproc", "2", "--set", "parallel.dp_shard=2", "--set", "checkpoint.every=3")
    assert resumed["steps"] == 12 and resumed["steps_this_run"] < 12
    assert resumed["params_sha256"] == two["params_sha256"]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "resume" for e in events)
