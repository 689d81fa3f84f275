"""``checkpoint.every_minutes``: timed saves are rank 0's call, heard by every rank in the stop vote, so a 2-process
run (real torchrun workers, gloo) saves the same steps on both ranks; the resume hint names the full command."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import shared_ranks
import torch
from in_process import crosstrain_main

from crosstrain.checkpoint.manager import step_dirs
from crosstrain.checkpoint.verify import verify
from crosstrain.engine.preemption import PreemptionWatcher, StopVote
from crosstrain.engine.resume_hint import resume_command, without_run_dir


def _votes(collective: Any) -> list[tuple[bool, bool]]:
    """Each rank's (stop, save) answer when only rank 0's clock is due, only rank 1's, and rank 1 gets SIGTERM."""
    watcher = PreemptionWatcher()
    vote = StopVote(collective, watcher, torch.device("cpu"))
    rank = collective.rank
    out = []
    for index, due, stop in ((0, rank == 0, False), (1, rank == 1, False), (2, False, rank == 1)):
        watcher.requested = stop
        ballot = vote.start(index, [], save_due=due)
        out.append((vote.finish(ballot), vote.save_due(ballot)))
    return out


def test_timed_save_is_rank_0s_call_on_every_rank() -> None:
    rank0, rank1 = shared_ranks.run(_votes)
    assert rank0 == rank1 == [(False, True), (False, False), (True, False)]


def test_two_ranks_save_the_same_timed_steps(tmp_path: Path) -> None:
    """Saves by the clock alone (checkpoint.every=0): every checkpoint holds both ranks' files and verifies (a
    save one rank skipped would hang the collective write until fault.collective_timeout_s)."""
    run = tmp_path / "run"
    # the ranks vote every step for the first 6 (then every ~0.5 s, which a fast host may not reach in 30 steps):
    # a 3 ms interval is due at several of those votes on any host (a step of the default model takes longer)
    sets = [
        "logging.progress=none",
        "logging.tensorboard=false",
        "eval.every=0",
        "backend=cpu",
        "train.steps=30",
        "checkpoint.every=0",
        "checkpoint.every_minutes=0.00005",
        "checkpoint.keep_last=100",
        "parallel.dp_replicate=2",
        "fault.collective_timeout_s=60",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        "-m",
        "crosstrain",
        "train",
        "--nproc",
        "2",
        *[a for s in sets for a in ("--set", s)],
        "--run-dir",
        str(run),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    saved = [e["step"] for e in events if e["event"] == "checkpoint"]
    timed = [s for s in saved if s != 30]  # 30: the final checkpoint
    assert len(timed) >= 2, saved
    assert sorted(s for s, _ in step_dirs(run / "checkpoints")) == saved
    for step, path in step_dirs(run / "checkpoints"):
        assert verify(path).ok, (step, verify(path).problems)
        assert {p.name for p in path.glob("rank*.json")} == {"rank0.json", "rank1.json"}, step


def test_resume_command_repeats_the_arguments_shell_quoted() -> None:
    argv = [
        "-v",
        "train",
        "my config.toml",
        "--set",
        "optim.lr=3e-4",
        "--run-dir",
        "old",
        "--recipe",
        "dpo",
        "--nproc",
        "2",
        "--set",
        "data.path=it's.jsonl",
        "--run-dir=older",
        "--run",
        "oldest",
    ]
    assert without_run_dir(argv) == [
        "-v",
        "train",
        "my config.toml",
        "--set",
        "optim.lr=3e-4",
        "--recipe",
        "dpo",
        "--nproc",
        "2",
        "--set",
        "data.path=it's.jsonl",
    ]
    line = resume_command(argv, "/runs/a b")
    assert shlex.split(line) == ["crosstrain", *without_run_dir(argv), "--run-dir", "/runs/a b"]
    # without the arguments (a Trainer built in Python) the run's own config.toml stands for them
    assert shlex.split(resume_command(None, "/r")) == ["crosstrain", "train", "/r/config.toml", "--run-dir", "/r"]


CRASH_MODEL = """
from crosstrain.models.gpt import GPT, GPTConfig


class CrashAtSeven(GPT):
    calls = 0

    def forward(self, tokens):
        CrashAtSeven.calls += 1
        if CrashAtSeven.calls == 7:
            raise RuntimeError("simulated crash in forward 7")
        return super().forward(tokens)


def build(section):
    return CrashAtSeven(GPTConfig(dim=32, n_layers=1, n_heads=2, max_seq_len=64))
"""


def test_a_crash_after_a_checkpoint_prints_the_command_that_resumes(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "crash_at_seven.py").write_text(CRASH_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    argv = [
        "train",
        "--set",
        "model.import_path=crash_at_seven:build",
        "--set",
        "train.steps=10",
        "--set",
        "checkpoint.every=2",
        "--set",
        "train.seq_len=32",
        "--set",
        "train.batch_size=4",
        "--set",
        "eval.every=0",
        "--set",
        "logging.progress=none",
        "--set",
        "backend=cpu",
        "--run-dir",
        str(run),
    ]
    with pytest.raises(RuntimeError, match="simulated crash"):
        crosstrain_main(argv)
    err = capsys.readouterr().err
    assert f"newest checkpoint is step 6. Resume with: {shlex.join(['crosstrain', *argv])}" in err, err[-2000:]
