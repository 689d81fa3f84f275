"""``crosstrain eval RUN_OR_CHECKPOINT [--data PATH] [--best] [--json] [--set K=V] [--nproc N]``."""

from __future__ import annotations

import argparse
import json
import math
import sys


def _worker_args(args: argparse.Namespace) -> list[str]:
    out = ["eval", args.path]
    if args.data:
        out += ["--data", args.data]
    if args.best:
        out.append("--best")
    if args.json:
        out.append("--json")
    for item in args.set or []:
        out += ["--set", item]
    return out


def run(args: argparse.Namespace) -> int:
    from crosstrain.checkpoint.resolve import CHECKPOINT, resolve_path
    from crosstrain.config import load_config
    from crosstrain.engine.evaluate_checkpoint import evaluate_checkpoint
    from crosstrain.errors import ConfigError

    source = resolve_path(args.path, accept=CHECKPOINT, best=args.best)
    if source.run_dir is None:
        raise ConfigError(f"{str(source.path)!r} lies outside a run's checkpoints/ folder, so its run config is "
                          "unknown; pass the run dir or its checkpoints/step_N folder")
    config_file = source.run_dir / "config.toml"
    if not config_file.is_file():
        raise ConfigError(f"{str(config_file)!r} is missing; crosstrain eval needs the run dir a checkpoint came from")
    overrides = [*(args.set or []), *([f"data.val_path={args.data}"] if args.data else [])]
    config = load_config(config_file, overrides)
    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc={args.nproc} must be >= 1 (omit it to evaluate in this process)")
        from crosstrain.config import check_world
        from crosstrain.launch import launch

        check_world(config, args.nproc)
        return launch(_worker_args(args), nproc=args.nproc)
    result = evaluate_checkpoint(config, source.path, verified=source.verified)
    if result.pop("rank"):
        return 0  # every rank has the figures; rank 0 prints them
    if args.json:
        print(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                          for k, v in result.items()}))
    else:
        perplexity = f", perplexity {result['perplexity']:.4f}" if "perplexity" in result else ""
        print(f"crosstrain: eval of {result['checkpoint']} (step {result['step']}): loss {result['loss']:.6f}"
              f"{perplexity} over {result['samples']} samples", file=sys.stdout)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a saved checkpoint on held-out data (loss and perplexity)",
                       description="Evaluate a run's latest (or --best) checkpoint, or a step_N folder, with the "
                                   "run's config on its validation split or on --data.")
    p.add_argument("path", help="run dir, its checkpoints/ folder, or a checkpoints/step_N folder")
    p.add_argument("--data", default=None, help="token file to evaluate on instead of the run's validation split")
    p.add_argument("--best", action="store_true", help="the checkpoint with the best eval loss (keep_best runs)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key, e.g. --set parallel.tp=2")
    p.add_argument("--nproc", type=int, default=None, help="evaluate on N local worker processes")
    p.set_defaults(func=run)
