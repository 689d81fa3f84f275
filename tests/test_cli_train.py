"""`crosstrain train` end to end: config errors (exit 2, nothing written), --nproc 2 DDP parity, SIGTERM."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from in_process import crosstrain_main

from crosstrain.cli.main import main
from crosstrain.config import load_config
from crosstrain.engine import Trainer

TINY = ["train.steps=6", "train.batch_size=4", "train.seq_len=32", "logging.every=1", "schedule.warmup_steps=2"]


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "train.stepz=3"], "unknown config key 'train.stepz'"),
        (["--set", "optim.lr=fast"], "invalid value for 'optim.lr'"),
        (["--set", "parallel.dp_replicate=2", "--set", "parallel.dp_shard=1"], "but the world size is 1"),
        (["--nproc", "2", "--set", "parallel.tp=4", "--set", "parallel.dp_shard=1"], "but the world size is 2"),
        (["--nproc", "2", "--set", "parallel.tp=3"], "does not divide the world size 2"),
        (["--nproc", "4", "--set", "parallel.tp=4", "--set", "parallel.dp_shard=1", "--set", "model.n_heads=2",
          "--set", "model.dim=32"], "parallel.tp=4 must divide model.n_heads=2"),
        (["--set", "model.preset=gigantic"], "unknown model.preset"),
    ],
)
def test_bad_config_exits_2_and_writes_nothing(tmp_path, capsys, args, needle) -> None:
    out = tmp_path / "runs"
    code = main(["train", *args, "--set", f"train.output_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("crosstrain: error: ") and needle in err[0]
    assert not out.exists()


def test_bad_toml_file_exits_2(tmp_path, capsys) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[model]\npreset = 'tiny'\nheads = 4\n")
    assert main(["train", str(cfg), "--set", f"train.output_dir={tmp_path / 'runs'}"]) == 2
    assert "unknown config key 'model.heads'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_nproc2_ddp_matches_single_process(tmp_path) -> None:
    opts = [*TINY, "train.steps=8", "backend=cpu", "logging.progress=plain"]
    single = Trainer(load_config(None, opts), run_dir=tmp_path / "single").fit()
    cmd = [sys.executable, "-m", "crosstrain", "train", "--nproc", "2", *_sets([*opts, "parallel.dp_replicate=2"]),
           "--run-dir", str(tmp_path / "ddp")]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert ddp["world_size"] == 2 and ddp["mesh"]["dp_replicate"] == 2 and ddp["steps"] == 8
    assert len(ddp["losses"]) == len(single["losses"]) == 8
    for a, b in zip(single["losses"], ddp["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (single["losses"], ddp["losses"])
    assert "crosstrain: done: 8 steps on cpu x2" in proc.stdout


def test_sigterm_saves_and_exits_0_then_resumes(tmp_path, capsys) -> None:
    """SIGTERM to `crosstrain train --nproc 2`: the agent forwards it, both ranks agree, finish the step, save and
    exit 0; the run then resumes in a single process (a different layout) at the saved step."""
    run_dir = tmp_path / "run"
    opts = [*TINY, "train.steps=100000", "backend=cpu", "logging.progress=plain"]
    cmd = [sys.executable, "-m", "crosstrain", "train", *_sets(opts), "--run-dir", str(run_dir)]
    proc = subprocess.Popen([*cmd[:4], "--nproc", "2", *cmd[4:], *_sets(["parallel.dp_replicate=2"])],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM received; finished step" in err and "the workers saved a checkpoint" in err
    # rank 0 and the launcher name the command that resumes: the one typed, --nproc included, plus --run-dir
    typed = ["train", "--nproc", "2", *_sets(opts), *_sets(["parallel.dp_replicate=2"])]
    hint = f"Resume with: {shlex.join(['crosstrain', *typed, '--run-dir', str(run_dir)])}"
    assert [line.endswith(hint) for line in err.splitlines()].count(True) == 2, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["preempted"] is True and summary["world_size"] == 2 and stopped >= 3
    assert (run_dir / "checkpoints" / f"step_{stopped}").is_dir()
    capsys.readouterr()
    assert crosstrain_main([*cmd[3:-2], "--set", f"train.steps={stopped + 2}", "--run-dir", str(run_dir)]) == 0
    resumed = capsys.readouterr()  # in this process: one rank, on one thread as the workers
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped}'} at step {stopped}" in resumed.err
    final = json.loads((run_dir / "summary.json").read_text())
    assert final["steps"] == stopped + 2 and final["steps_this_run"] == 2 and final["world_size"] == 1
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, stopped + 3))


CRASH_MODEL = '''
import os
from crosstrain.models.gpt import GPT, GPTConfig


class CrashOnce(GPT):
    """Rank 1 dies (exit 17) on its 5th forward unless the marker file exists; otherwise a plain GPT."""

    calls = 0

    def forward(self, tokens):
        CrashOnce.calls += 1
        marker = os.environ["CRASH_MARKER"]
        if CrashOnce.calls == 5 and os.environ.get("RANK") == "1" and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(17)
        return super().forward(tokens)


def build(section):
    return CrashOnce(GPTConfig(dim=32, n_layers=1, n_heads=2, max_seq_len=64))
'''


def test_elastic_restart_resumes_from_latest_checkpoint(tmp_path) -> None:
    (tmp_path / "crashmodel.py").write_text(CRASH_MODEL)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    env["CRASH_MARKER"] = str(tmp_path / "crashed")
    run_dir = tmp_path / "run"
    opts = [*TINY, "train.steps=8", "model.import_path=crashmodel:build", "parallel.dp_replicate=2",
            "checkpoint.every=2", "logging.progress=plain"]
    proc = subprocess.run([sys.executable, "-m", "crosstrain", "train", "--nproc", "2", "--max-restarts", "1",
                           *_sets(opts), "--run-dir", str(run_dir)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "crashed").exists()  # the first attempt really died
    assert "resumed from" in proc.stderr and "at step 4" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["steps_this_run"] == 4
    # without restarts allowed the same crash is reported with the worker's exit code
    env["CRASH_MARKER"] = str(tmp_path / "crashed-again")
    failed = subprocess.run([sys.executable, "-m", "crosstrain", "train", "--nproc", "2", *_sets(opts),
                             "--run-dir", str(tmp_path / "run2")], env=env, capture_output=True, text=True,
                            timeout=300)
    assert failed.returncode == 17
    assert "crosstrain: error: worker rank 1 failed with exit code 17" in failed.stderr
