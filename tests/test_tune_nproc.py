"""Pruning under a multi-process layout: trial 1 of a ``--nproc 2`` search is pruned at its first evaluation by
rank 0, and both ranks stop together at the next stop vote with a checkpoint of that step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optuna")

from test_tune_kill import SPACE, TINY, _sets  # noqa: E402


def test_a_pruned_two_process_trial_stops_every_rank_at_one_step(tmp_path: Path) -> None:
    space, out = tmp_path / "space.toml", tmp_path / "out"
    space.write_text(SPACE)
    sets = [s for s in TINY if not s.startswith("train.steps")] + ["train.steps=8", "parallel.dp_shard=2"]
    done = subprocess.run([sys.executable, "-m", "crosstrain", "tune", str(space), "--trials", "2", "--nproc", "2",
                           "--out", str(out), "--json", *_sets(sets)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["complete"], result["pruned"], result["failed"]) == (1, 1, 0)
    pruned = out / "space" / "trial_0001"
    summary = json.loads((pruned / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["preempted"]
    stopped = summary["steps"]
    assert 4 <= stopped < 8  # pruned at step 4; the ranks agree to stop at the next vote
    last = [json.loads((pruned / "ranks" / f"metrics.rank{r}.jsonl").read_text().splitlines()[-1])["step"]
            for r in (0, 1)]
    assert last == [stopped, stopped]
    assert (pruned / "checkpoints" / f"step_{stopped}").is_dir()
    events = [json.loads(line) for line in (pruned / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "tune_pruned"] == [4]
