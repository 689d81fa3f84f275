"""30 kill -9 trials at random moments during saves: afterwards ``latest`` verifies and resuming works."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from crosstrain.checkpoint.manager import CheckpointManager, read_latest_pointer, step_dirs
from crosstrain.checkpoint.verify import verify

TRIALS = 30


def _state_for(step: int) -> dict:
    return {"w": {"a": torch.full((96, 1024), float(step)), "b": torch.arange(4096, dtype=torch.int64) * step,
                  "step": step, "tag": f"s{step}"}}


def _saver(folder: Path, start: int, async_save: bool) -> None:
    """Child: save step after step until killed."""
    code = 1
    try:
        mgr = CheckpointManager(folder, keep_last=2, keep_every=5, async_save=async_save)
        (folder / "started").touch()
        step = start
        while True:  # async: as the trainer does it (background staging, fence, non-blocking agreement)
            mgr.save(step, _state_for(step), stage_later=("w",) if async_save else ())
            mgr.fence()
            mgr.check_background()
            mgr.start_check()
            step += 1
    except BaseException as exc:  # noqa: BLE001 - report, then leave without running the parent's atexit
        print(f"saver failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        os._exit(code)


@pytest.mark.skipif("forkserver" not in mp.get_all_start_methods(), reason="needs forkserver")
def test_kill_9_during_saves_leaves_a_valid_latest(tmp_path: Path) -> None:
    rng = random.Random(1234)
    folder = tmp_path / "checkpoints"
    with CheckpointManager(folder) as mgr:
        mgr.save(0, _state_for(0))
    # children fork from a server that has imported torch but never run a parallel op (fork-safe and fast)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "crosstrain.checkpoint.manager"])
    killed_mid_save = 0
    next_step = 1
    for trial in range(TRIALS):
        async_save = trial % 2 == 1
        proc = ctx.Process(target=_saver, args=(folder, next_step, async_save))
        proc.start()
        deadline = time.monotonic() + 60
        while not (folder / "started").exists() and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.3))
        killed_mid_save += any(p.name.endswith(".tmp") for p in folder.iterdir())
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL, f"trial {trial}: saver exited on its own ({proc.exitcode})"
        (folder / "started").unlink()

        # every step_N that exists is complete (atomic commit), and `latest` names a valid one
        for _step, path in step_dirs(folder):
            report = verify(path)
            assert report.ok, f"trial {trial}: {path} exists but is not valid: {report.reason}"
        pointer = read_latest_pointer(folder)
        assert pointer is not None and verify(folder / pointer).ok, f"trial {trial}: latest -> {pointer}"
        mgr = CheckpointManager(folder)
        info = mgr.latest()
        assert info is not None
        target: dict = {"w": {"a": torch.zeros(96, 1024), "b": torch.zeros(4096, dtype=torch.int64)}}
        assert mgr.load(info, target) == info.step
        expected = _state_for(info.step)["w"]
        assert torch.equal(target["w"]["a"], expected["a"]) and torch.equal(target["w"]["b"], expected["b"])
        assert target["w"]["step"] == info.step and target["w"]["tag"] == f"s{info.step}"
        next_step = info.step + 1
    print(f"{TRIALS} kills, {killed_mid_save} mid-save, last step {next_step - 1}")
    assert next_step > TRIALS // 2, "the saver made too little progress for the trials to mean anything"
    assert killed_mid_save >= TRIALS // 3, f"only {killed_mid_save} kills landed during a save"
    # leftovers of killed saves are cleaned up by the next manager
    CheckpointManager(folder).close()
    assert not [p for p in folder.iterdir() if p.name.endswith((".tmp", ".deleting", ".old"))]
