"""``crosstrain eval RUN_OR_CHECKPOINT [--data PATH] [--best] [--json] [--set K=V] [--nproc N]``, and with
``--tasks NAME_OR_YAML[,...] [--limit N] [--num-fewshot K] [--log-samples]`` benchmark tasks (lm-evaluation-harness
in process, :mod:`crosstrain.engine.evaluate_tasks`) instead of the loss."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


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
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    if args.tasks is not None and not tasks:
        raise ConfigError("--tasks is empty; pass task names or task YAML paths, comma separated")
    if not tasks and (args.limit is not None or args.num_fewshot is not None or args.log_samples):
        raise ConfigError("--limit, --num-fewshot and --log-samples apply to --tasks; add --tasks NAME_OR_YAML")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit={args.limit} must be >= 1 (omit it to score every item)")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot={args.num_fewshot} must be >= 0 (omit it for each task's own)")
    predictions = _predictions_path(args.predictions, tasks, args.nproc)
    if tasks and args.nproc is not None:
        raise ConfigError("--tasks scores in this process; drop --nproc")
    overrides = [*(args.set or []), *([f"data.val_path={args.data}"] if args.data else []),
                 *([f"eval.tasks={json.dumps(tasks)}"] if tasks else [])]  # validated like the config key
    config = load_config(config_file, overrides)
    if tasks:
        return _score(args, config, source, tasks)
    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc={args.nproc} must be >= 1 (omit it to evaluate in this process)")
        from crosstrain.config import check_world
        from crosstrain.launch import launch

        check_world(config, args.nproc)
        return launch(_worker_args(args), nproc=args.nproc)
    result = evaluate_checkpoint(config, source.path, verified=source.verified, predictions=predictions is not None)
    if result.pop("rank"):
        return 0  # every rank has the figures; rank 0 prints them
    if predictions is not None:
        from crosstrain.checkpoint.atomic import atomic_write

        rows = result.pop("predictions")
        atomic_write(predictions, "".join(json.dumps(row) + "\n" for row in rows))
        result["predictions"] = str(predictions)
    if args.json:
        print(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                          for k, v in result.items()}))
    else:
        perplexity = f", perplexity {result['perplexity']:.4f}" if "perplexity" in result else ""
        print(f"crosstrain: eval of {result['checkpoint']} (step {result['step']}): loss {result['loss']:.6f}"
              f"{perplexity} over {result['samples']} samples", file=sys.stdout)
    return 0


def _predictions_path(value: str | None, tasks: list[str], nproc: int | None) -> Path | None:
    """``--predictions FILE``, checked before any weights load: one process, no --tasks, a file in a folder."""
    from crosstrain.errors import ConfigError

    if value is None:
        return None
    if tasks or nproc is not None:
        raise ConfigError("--predictions writes the samples of one process's loss evaluation; drop "
                          + ("--tasks" if tasks else "--nproc"))
    path = Path(value)
    if path.is_dir() or not path.parent.is_dir():
        raise ConfigError(f"--predictions {value}: give a file path in an existing folder (JSON lines are written)")
    return path


def _score(args: argparse.Namespace, config: Any, source: Any, tasks: list[str]) -> int:
    from crosstrain.engine.evaluate_checkpoint import score_checkpoint

    result = score_checkpoint(config, source.path, tasks, verified=source.verified, limit=args.limit,
                              num_fewshot=args.num_fewshot, log_samples=args.log_samples)
    if not args.log_samples:
        result.pop("samples", None)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"crosstrain: lm-eval tasks on {result['checkpoint']} (step {result['step']})")
    width = max((len(k) for k in result["scores"]), default=0)
    for key, value in result["scores"].items():
        print(f"  {key:<{width}}  {value:.4f}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a saved checkpoint on held-out data (loss and perplexity) or on "
                                    "lm-eval tasks (--tasks)",
                       description="Evaluate a run's latest (or --best) checkpoint, or a step_N folder, with the "
                                   "run's config on its validation split or on --data; with --tasks, score "
                                   "lm-evaluation-harness tasks in process instead (docs/evaluate.md).")
    p.add_argument("path", help="run dir, its checkpoints/ folder, or a checkpoints/step_N folder")
    p.add_argument("--data", default=None, help="token file to evaluate on instead of the run's validation split")
    p.add_argument("--best", action="store_true", help="the checkpoint with the best eval loss (keep_best runs)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key, e.g. --set parallel.tp=2")
    p.add_argument("--nproc", type=int, default=None, help="evaluate on N local worker processes")
    p.add_argument("--predictions", default=None, metavar="FILE",
                   help="also write each evaluated sample's prediction as JSON lines (recipes that have them: "
                        "classify gives label and top-1)")
    p.add_argument("--tasks", default=None, metavar="NAME_OR_YAML[,...]",
                   help="score lm-evaluation-harness tasks instead of the loss: registered names or local task "
                        "YAML files (needs crosstrain[eval])")
    p.add_argument("--limit", type=int, default=None, help="--tasks: only the first N items of each task")
    p.add_argument("--num-fewshot", type=int, default=None, help="--tasks: K few-shot examples (default: the task's)")
    p.add_argument("--log-samples", action="store_true", help="--tasks --json: also each item's responses")
    p.set_defaults(func=run)
