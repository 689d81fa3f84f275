"""What pruning saves: the same ``crosstrain tune`` study (example space, same seed, same trials) with the median
pruner and without, side by side in one run.

Each trial is a real ``crosstrain train`` run. ``steps_saved_fraction`` = 1 - (optimizer steps all trials of the
pruned study trained) / (steps of the unpruned one); ``best_ratio`` = best metric with pruning / without (<= 1.02:
pruning found a config as good). ``--quick`` trains a smaller model for fewer steps.

Last line: JSON ``{"steps_saved_fraction", "best_ratio", "best_pruned", "best_unpruned", "steps_pruned",
"steps_unpruned", "pruned_trials", "trials", "wall_s"}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUICK = ["train.steps=60", "eval.every=10", "eval.steps=4", "train.batch_size=8", "train.seq_len=64",
         "model.n_layers=2", "model.dim=64", "model.n_heads=4"]
FULL = ["train.steps=120", "eval.every=20"]


def study(space: Path, out: Path, trials: int, sets: list[str]) -> tuple[dict, int]:
    """Run one study; its result line and the optimizer steps its trials trained."""
    argv = [sys.executable, "-m", "crosstrain", "tune", str(space), "--trials", str(trials), "--out", str(out),
            "--json", *[a for s in sets for a in ("--set", s)]]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"tune failed: {done.stderr.strip().splitlines()[-1:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    steps = sum(json.loads(p.read_text())["steps"] for p in out.glob("*/trial_*/summary.json"))
    return result, steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, 60 steps per trial")
    ap.add_argument("--trials", type=int, default=8)
    args = ap.parse_args()
    from importlib import resources

    example = resources.files("crosstrain.plugins.tune").joinpath("example_space.toml").read_text()
    sets = [*(QUICK if args.quick else FULL), "logging.tensorboard=false", "logging.progress=none"]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="crosstrain-tune-bench-") as tmp:
        root = Path(tmp)
        spaces = {}
        for name, pruner in (("pruned", "median"), ("unpruned", "none")):
            spaces[name] = root / f"{name}.toml"
            spaces[name].write_text(example.replace('pruner = "median"', f'pruner = "{pruner}"'))
        pruned, steps_pruned = study(spaces["pruned"], root / "pruned", args.trials, sets)
        unpruned, steps_unpruned = study(spaces["unpruned"], root / "unpruned", args.trials, sets)
    result = {
        "steps_saved_fraction": 1 - steps_pruned / steps_unpruned,
        "best_ratio": pruned["best_value"] / unpruned["best_value"],
        "best_pruned": pruned["best_value"],
        "best_unpruned": unpruned["best_value"],
        "steps_pruned": steps_pruned,
        "steps_unpruned": steps_unpruned,
        "pruned_trials": pruned["pruned"],
        "trials": args.trials,
        "wall_s": time.perf_counter() - start,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
