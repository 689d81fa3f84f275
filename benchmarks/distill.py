"""Knowledge distillation: a ``tiny`` student distilled from a ``small`` teacher vs the same student on labels alone.

One process, the embedded corpus, byte tokenizer. First a ``small`` teacher is trained with ``--recipe lm``
(``--teacher-steps`` of ``--teacher-batch-size`` x 128 tokens). Then the same ``tiny`` student (same
``train.seed``: same initial weights, same batches in the same order, same steps, optimizer and schedule,
``--batch-size`` sequences a step) is trained twice: on the labels (``--recipe lm``) and with ``--recipe distill``
from that teacher (``distill.*`` from the flags). Both are evaluated on the whole held-out split at the end; the
figure is the student's held-out token NLL (``eval/loss`` of lm, ``eval/nll/student`` of distill: the same mean
cross-entropy over the same tokens).

Last line JSON: ``kd_vs_ce`` (held-out NLL distilled / labels-only; < 1: distillation helped),
``seconds_per_step_vs_ce`` (median step time distilled / labels-only: the teacher's forward and the divergence),
the NLLs of the teacher and of both students, and the settings.

    python benchmarks/distill.py --quick        # minutes on CPU
    python benchmarks/distill.py [--teacher-steps 600] [--steps 400] [--loss jsd] [--top-k 0] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch


def _common(args: argparse.Namespace, batch_size: int) -> list[str]:
    return ["backend=cpu", f"train.seq_len={args.seq_len}", f"train.batch_size={batch_size}",
            "train.seed=0", "eval.steps=0", "eval.batch_size=16", "checkpoint.every=0", "logging.progress=none",
            "logging.tensorboard=false", f"optim.lr={args.lr}", "schedule.warmup_steps=10"]


def _fit(sets: list[str], run_dir: Path) -> dict[str, Any]:
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    return dict(Trainer(load_config(None, sets), run_dir=str(run_dir)).fit())


def _last_eval(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in reversed(rows) if "eval/loss" in r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the acceptance settings (short runs)")
    parser.add_argument("--teacher-steps", type=int, default=600)
    parser.add_argument("--steps", type=int, default=400, help="student steps (both students)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="student sequences per step (both students)")
    parser.add_argument("--teacher-batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--loss", default="forward_kl", choices=("forward_kl", "reverse_kl", "jsd"))
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--work", default=None, help="keep the runs in this folder (its finished teacher is reused)")
    args = parser.parse_args()
    if args.quick:
        args.teacher_steps, args.steps = 300, 200
    torch.set_num_threads(1)
    common = _common(args, args.batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.work or tmp)
        if not (root / "teacher" / "summary.json").is_file():
            teacher = [*_common(args, args.teacher_batch_size), "model.preset=small"]
            _fit([*teacher, f"train.steps={args.teacher_steps}", f"eval.every={args.teacher_steps}"], root / "teacher")
        for name in ("ce", "kd"):
            shutil.rmtree(root / name, ignore_errors=True)
        student = [*common, "model.preset=tiny", f"train.steps={args.steps}", f"eval.every={args.steps}"]
        ce = _fit(student, root / "ce")
        kd = _fit([*student, "train.recipe=distill", f"distill.teacher={root / 'teacher'}",
                   f"distill.loss={args.loss}", f"distill.alpha={args.alpha}",
                   f"distill.loss_temperature={args.temperature}", f"distill.top_k_logits={args.top_k}"], root / "kd")
        ce_eval, kd_eval = _last_eval(root / "ce"), _last_eval(root / "kd")
    ce_nll, kd_nll = ce_eval["eval/loss"], kd_eval["eval/nll/student"]
    ratio_time = kd["median_step_time_s"] / ce["median_step_time_s"]
    print(f"held-out NLL: teacher (small) {kd_eval['eval/nll/teacher']:.4f}, tiny student on labels {ce_nll:.4f}, "
          f"distilled {kd_nll:.4f} ({args.loss}, alpha {args.alpha}, T {args.temperature}); "
          f"step time x{ratio_time:.2f}")
    print(json.dumps({"kd_vs_ce": kd_nll / ce_nll, "seconds_per_step_vs_ce": ratio_time,
                      "teacher_nll": kd_eval["eval/nll/teacher"], "ce_nll": ce_nll, "kd_nll": kd_nll,
                      "kd_final": kd_eval["eval/kd"], "ce_step_s": ce["median_step_time_s"],
                      "kd_step_s": kd["median_step_time_s"], "teacher_steps": args.teacher_steps,
                      "steps": args.steps, "loss": args.loss, "alpha": args.alpha, "temperature": args.temperature,
                      "top_k": args.top_k, "seq_len": args.seq_len, "batch_size": args.batch_size,
                      "teacher_batch_size": args.teacher_batch_size,
                      "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
