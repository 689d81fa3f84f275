"""Issue 41's figures on one machine, in one run: does ``parallel.compile=auto`` compile a short run after a warm
cache exists, and is summary.json's tokens/s the live rate?

Against a fresh compile cache (a temporary ``XDG_CACHE_HOME``): a ``--steps`` run under ``auto`` (eager: no
record yet; it records its eager step time), a run with ``parallel.compile=true`` (compiles, warms the inductor
cache and records its compile seconds and compiled step time), then the same ``auto`` run again: it compiles
only if steps x (eager - compiled step) exceeds the recorded compile seconds. For every run: summary.json's
``tokens_per_s`` over the live rate measured apart from it, by a clock read at every step's end (the time
between step ends, all per-step work included, the first step left out), and the rate a figure including the
first step would have shown (its time taken as the median step + ``compile_s``). Last line JSON.

    python benchmarks/figures.py [--steps 50] [--dim 64] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from _timing import step_clock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="crosstrain-figures-"))
    os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    import torch

    from crosstrain.config import load_config
    from crosstrain.engine.trainer import Trainer

    torch.set_num_threads(1)
    base = ["train.batch_size=4", "train.seq_len=64", f"model.dim={args.dim}", f"model.n_layers={args.layers}",
            "model.n_heads=2", "backend=cpu", "eval.every=0", "logging.progress=none", "logging.tensorboard=false",
            f"train.steps={args.steps}", "observability.per_rank=false"]
    out: dict[str, dict[str, float | str]] = {}
    for name, compile_ in (("auto_cold", "auto"), ("forced", "true"), ("auto_warm", "auto")):
        t0 = time.perf_counter()
        with step_clock() as clock:
            summary = Trainer(load_config(None, [*base, f"parallel.compile={compile_}"]),
                              run_dir=tmp / name).fit()
        wall = time.perf_counter() - t0
        intervals = clock.intervals  # step 2 onwards (the first interval ends at step 2)
        tokens = summary["tokens"] / summary["steps_this_run"]
        live = tokens * len(intervals) / sum(intervals)
        first = summary["steps_this_run"] * tokens / (sum(intervals) + summary["median_step_time_s"]
                                                      + summary["compile_s"])
        out[name] = {"compile_decision": summary["compile_decision"], "compile_s": round(summary["compile_s"], 2),
                     "compile_estimate_s": round(summary["compile_estimate_s"], 2),
                     "compile_saving_s": round(summary["compile_saving_s"], 3),
                     "tokens_per_s": round(summary["tokens_per_s"]), "live_tokens_per_s": round(live),
                     "summary_over_live": round(summary["tokens_per_s"] / live, 3),
                     "first_step_included_tokens_per_s": round(first), "wall_s": round(wall, 1)}
        print(name, out[name], file=sys.stderr)
    print(json.dumps({"steps": args.steps, "torch": torch.__version__, **out}))


if __name__ == "__main__":
    main()
