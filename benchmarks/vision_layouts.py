"""``--recipe classify`` on 2 data-parallel processes vs 1, and why a long run drifts: fp32 rounding, not the layout.

Three 400-step runs of the embedded digits (defaults, one thread each): one process (the reference), one process
with ``train.grad_accum=2`` (the same 16 images a step as two micro-batches of 8: the same arithmetic as 2 ranks,
summed in another order, no second process) and ``parallel.dp_shard=2`` on 2 processes. For each, the relative
difference of the logged loss from the reference's, per 50-step window, and the first step past 1e-5. If the
one-process split drifts like the 2-process run, the drift is fp32 reduction order amplified by training.

Last line: JSON ``{"max_rel_diff": {name: [per window]}, "first_step_over_1e-5": {name: step or null}, "top1": ...}``.

    python benchmarks/vision_layouts.py [--steps 400]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def run(run_dir: Path, steps: int, *sets: str, nproc: int = 1) -> dict:
    argv = [sys.executable, "-m", "crosstrain", "train", "--recipe", "classify", "--run-dir", str(run_dir)]
    for s in ("backend=cpu", "logging.progress=none", f"train.steps={steps}", f"eval.every={steps}",
              "eval.max_batches=0", "checkpoint.every=0", "checkpoint.final=false", "train.threads=1", *sets):
        argv += ["--set", s]
    if nproc > 1:
        argv += ["--nproc", str(nproc)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    subprocess.run(argv, check=True, capture_output=True, env=dict(env, OMP_NUM_THREADS="1"))
    summary = json.loads((run_dir / "summary.json").read_text())
    last = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    return {"losses": summary["losses"], "top1": last["eval/top1"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ref = run(Path(tmp) / "one", args.steps)
        others = {"one_process_grad_accum_2": run(Path(tmp) / "ga2", args.steps, "train.grad_accum=2"),
                  "dp_shard_2": run(Path(tmp) / "dp2", args.steps, "parallel.dp_shard=2", nproc=2)}
    windows, first = {}, {}
    for name, r in others.items():
        rel = [abs(a - b) / abs(a) for a, b in zip(ref["losses"], r["losses"], strict=True)]
        windows[name] = [max(rel[i:i + 50]) for i in range(0, len(rel), 50)]
        first[name] = next((i + 1 for i, x in enumerate(rel) if x > 1e-5), None)
    print(json.dumps({"steps": args.steps, "window": 50, "max_rel_diff": windows, "first_step_over_1e-5": first,
                      "top1": {"one_process": ref["top1"], **{k: r["top1"] for k, r in others.items()}}}))


if __name__ == "__main__":
    main()
