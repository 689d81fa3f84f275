"""``crosstrain distill demo``: the one-command distillation demo on the embedded corpus, no files needed.

Trains a ``small`` teacher with ``--recipe lm`` into ``RUN_DIR/teacher``, then distills a ``tiny`` student from it
with ``--recipe distill`` into ``RUN_DIR/student``, in this process, and prints both held-out NLLs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def run_demo(run_dir: Path, teacher_steps: int, steps: int, extra: list[str]) -> dict[str, Any]:
    """Train the teacher (unless ``RUN_DIR/teacher`` holds a finished run), then the student; the student's and the
    teacher's final held-out NLL and where the runs are."""
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    common = ["train.seq_len=128", "train.batch_size=16", "eval.steps=0", "checkpoint.every=0", *extra]
    teacher = run_dir / "teacher"
    if not (teacher / "summary.json").is_file():
        sets = [*common, "model.preset=small", f"train.steps={teacher_steps}", f"eval.every={teacher_steps}"]
        Trainer(load_config(None, sets), run_dir=str(teacher)).fit()
    sets = [*common, "train.recipe=distill", "model.preset=tiny", f"distill.teacher={teacher}",
            f"train.steps={steps}", f"eval.every={steps}"]
    Trainer(load_config(None, sets), run_dir=str(run_dir / "student")).fit()
    rows = [json.loads(x) for x in (run_dir / "student" / "metrics.jsonl").read_text().splitlines()]
    last = next(r for r in reversed(rows) if "eval/loss" in r)
    return {"teacher": str(teacher), "student": str(run_dir / "student"),
            "eval_nll_teacher": last["eval/nll/teacher"], "eval_nll_student": last["eval/nll/student"],
            "eval_kd": last["eval/kd"]}
