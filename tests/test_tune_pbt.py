"""PBT through crosstrain's checkpoints: after round 0 the worse member resumes from the better one's checkpoint
(exploit) and trains round 1 with that member's learning rate perturbed by x1.25 or /1.25 (explore), on one cosine
decay over both rounds (``schedule.total_steps``), not one per round."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optuna")

from test_tune_kill import TINY, _sets  # noqa: E402

SPACE = """[tune]
strategy = "pbt"
population = 2
rounds = 2
pruner = "none"
[space]
"optim.lr" = { low = 1e-4, high = 1e-2, log = true }
"""


def test_pbt_exploits_a_checkpoint_and_explores_its_hyperparameters(tmp_path: Path) -> None:
    space, out = tmp_path / "space.toml", tmp_path / "out"
    space.write_text(SPACE)
    sets = [s for s in TINY if not s.startswith("train.steps")]
    sets += ["train.steps=8", "schedule.name=cosine", "schedule.warmup_steps=0"]
    done = subprocess.run([sys.executable, "-m", "crosstrain", "tune", str(space), "--out", str(out), "--json",
                           *_sets(sets)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["complete"], result["failed"]) == (2, 0)
    state = json.loads((out / "space" / "pbt.json").read_text())
    assert state["round"] == 2
    first = [m["values"][0] for m in state["members"]]
    loser, winner = (0, 1) if first[0] > first[1] else (1, 0)
    assert state["members"][loser]["exploited"] == [{"round": 0, "from": winner}]
    assert state["members"][winner]["exploited"] == []
    winner_lr = state["members"][winner]["params"]["optim.lr"]
    explored_lr = state["members"][loser]["params"]["optim.lr"]
    assert explored_lr in (pytest.approx(winner_lr * 1.25), pytest.approx(winner_lr / 1.25))

    loser_dir = out / "space" / f"member_{loser:02d}"
    source = (out / "space" / f"member_{winner:02d}" / "checkpoints" / "step_4").resolve()
    events = [json.loads(line) for line in (loser_dir / "events.jsonl").read_text().splitlines()]
    assert [e["checkpoint"] for e in events if e["event"] == "resume"] == [str(source)]
    rows = [json.loads(line) for line in (loser_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))  # rounds 0 and 1, no step trained twice
    from crosstrain.optim.schedules import lr_factor

    def cosine(step: int) -> float:  # the factor of 1-based step ``step`` of one 8-step decay
        return lr_factor(step - 1, total_steps=8, warmup_steps=0, name="cosine", min_lr_ratio=0.1)

    assert all(r["lr"] == pytest.approx(explored_lr * cosine(r["step"])) for r in rows if r["step"] > 4)
    winner_rows = [json.loads(line) for line in
                   (out / "space" / f"member_{winner:02d}" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in winner_rows] == pytest.approx([winner_lr * cosine(step) for step in range(1, 9)])
    assert winner_rows[4]["lr"] < winner_rows[3]["lr"]  # round 1 goes on decaying: no restart at step 5
    assert result["best_value"] == pytest.approx(min(m["values"][-1] for m in state["members"]))
