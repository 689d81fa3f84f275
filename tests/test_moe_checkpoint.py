"""MoE checkpoints reshard across ep sizes (2 real gloo ranks, FSDP2 + ep): a run at ep=2 resumed at ep=1 from its
step-2 checkpoint, and that run's step-4 checkpoint resumed at ep=2 again, continue the ep=2 run's losses within
1e-5 (expert weights are DTensors whose global shape does not depend on ep). The three runs share the session's
2 ranks (tests/shared_ranks.py: the trainer on an existing process group); the CLI's launcher is tested elsewhere."""

from __future__ import annotations

from pathlib import Path

import shared_ranks

TOL = 1e-5
COMMON = ["train.batch_size=4", "train.seq_len=32", "logging.progress=none", "schedule.warmup_steps=0",
          "model.n_layers=2", "moe.experts=4", "moe.capacity_factor=1.5", "checkpoint.every=2",
          "checkpoint.keep_last=10", "backend=cpu", "parallel.dp_shard=2"]  # FSDP2 (+ ep) at every ep


def _train(out: Path, ep: int, steps: int, resume: Path | None = None) -> dict:
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    sets = [*COMMON, f"parallel.ep={ep}", f"train.steps={steps}"]
    if resume is not None:
        sets.append(f"checkpoint.resume={resume}")
    return Trainer(load_config(None, sets), run_dir=out).fit()


def _reshard_runs(collective, root: str) -> dict[str, dict]:
    a, b, c = Path(root) / "a", Path(root) / "b", Path(root) / "c"
    # the same train.steps everywhere: the LR schedule depends on it
    runs = {"a": _train(a, ep=2, steps=6)}
    runs["b"] = _train(b, ep=1, steps=6, resume=a / "checkpoints" / "step_2")
    runs["c"] = _train(c, ep=2, steps=6, resume=b / "checkpoints" / "step_4")
    return {name: {k: s[k] for k in ("losses", "mesh", "steps_this_run")} for name, s in runs.items()}


def test_checkpoints_reshard_between_ep2_and_ep1(tmp_path):
    rank0, rank1 = shared_ranks.run(_reshard_runs, str(tmp_path), timeout=300)
    assert rank1 == rank0  # every rank reports the same run
    assert [rank0[r]["mesh"]["ep"] for r in "abc"] == [2, 1, 2]
    losses, resumed, back = (rank0[r]["losses"] for r in "abc")
    assert len(losses) == 6 and len(resumed) == 4 and rank0["b"]["steps_this_run"] == 4
    for got, want in zip(resumed, losses[2:], strict=True):
        assert abs(got - want) <= TOL * max(1.0, abs(want)), (resumed, losses)
    assert len(back) == 2
    for got, want in zip(back, losses[4:6], strict=True):
        assert abs(got - want) <= TOL * max(1.0, abs(want)), (back, losses)
