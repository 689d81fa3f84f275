"""``crosstrain train [CONFIG] [--set key=value ...] [--run-dir DIR] [--nproc N]``."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports nothing heavy until a command runs
    from crosstrain.engine import Trainer


def _worker_args(args: argparse.Namespace, run_dir: str) -> list[str]:
    out = ["-v", "train"] if getattr(args, "verbose", False) else ["train"]  # rank 0 reports the defaults
    if args.config:
        out.append(args.config)
    for item in _overrides(args):
        out += ["--set", item]
    out += ["--run-dir", run_dir]
    if args.preempted_exit_code:  # the workers exit with it, so a launcher whose workers stopped by vote does too
        out += ["--preempted-exit-code", str(args.preempted_exit_code)]
    return out


def _overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` items, with ``--recipe NAME`` as ``train.recipe=NAME`` (it wins over the config file)."""
    return [*(args.set or []), *([f"train.recipe={args.recipe}"] if args.recipe else [])]


def _eval_part(summary: dict) -> str:
    """``, eval loss 1.2345 (best 1.2001 at step 300)`` when the run evaluated."""
    import math

    loss, best = summary.get("eval_loss"), summary.get("best_eval_loss")
    if not isinstance(loss, float) or not math.isfinite(loss):
        return ""
    part = f", eval loss {loss:.4f}"
    if isinstance(best, float) and math.isfinite(best) and best < loss:
        part += f" (best {best:.4f} at step {summary.get('best_eval_step')})"
    return part


def _check_launch(args: argparse.Namespace) -> int:
    """Validate --nproc / --nnodes / --max-restarts; returns the (maximum) number of nodes."""
    from crosstrain.errors import ConfigError

    if args.nproc < 1:
        raise ConfigError(f"--nproc={args.nproc} must be >= 1 (omit it to train in this process)")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts={args.max_restarts} must be >= 0")
    _check_exit_code(args)
    parts = str(args.nnodes).split(":")
    if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or int(parts[0]) > int(parts[-1]):
        raise ConfigError(f"--nnodes={args.nnodes!r} must be a number of nodes N >= 1 or a range MIN:MAX")
    nodes = int(parts[-1])
    if nodes > 1 and not args.run_dir:
        raise ConfigError(f"--nnodes={args.nnodes} needs --run-dir DIR on storage every node shares (each node "
                          "would pick its own timestamped run dir)")
    return nodes


def _check_exit_code(args: argparse.Namespace) -> None:
    from crosstrain.errors import ConfigError

    if not 0 <= args.preempted_exit_code <= 255:
        raise ConfigError(f"--preempted-exit-code={args.preempted_exit_code} must be an exit status, 0 to 255")


def rdzv_id(args: argparse.Namespace, run_dir: str) -> str | None:
    """``--rdzv-id``, else one derived from the run dir for a multi-node job (the same on every node that names the
    same run dir; c10d keys its rendezvous by it), else None (one node: the launcher picks a random one)."""
    import hashlib

    if args.rdzv_id or str(args.nnodes) in ("1", "1:1"):
        return args.rdzv_id or None
    return "crosstrain-" + hashlib.sha256(run_dir.rstrip("/").encode()).hexdigest()[:12]


def _resume_argv(args: argparse.Namespace) -> list[str] | None:
    """The arguments the resume hint repeats: the launcher's (a worker of ``--nproc``), else this command's
    (None when ``run`` was called without :func:`crosstrain.cli.main.main`: the hint names the run's config)."""
    import json
    import os

    from crosstrain.engine.resume_hint import ENV_RESUME_ARGV

    handed = os.environ.get(ENV_RESUME_ARGV)
    if handed and "RANK" in os.environ:  # only a launched worker takes it: a stale export elsewhere is ignored
        return list(json.loads(handed))
    argv = getattr(args, "cli_argv", None)
    return None if argv is None else list(argv)


def _launch(args: argparse.Namespace, run_dir: str, argv: list[str] | None) -> int:
    """Start the ``--nproc`` workers, handing them ``argv`` for their resume hint."""
    import json
    import os

    from crosstrain.engine.resume_hint import ENV_RESUME_ARGV, resume_command
    from crosstrain.launch import launch

    previous = os.environ.get(ENV_RESUME_ARGV)
    if argv is not None:
        os.environ[ENV_RESUME_ARGV] = json.dumps(argv)
    try:
        return launch(_worker_args(args, run_dir), nproc=args.nproc, max_restarts=args.max_restarts,
                      nnodes=str(args.nnodes), rdzv_endpoint=args.rdzv_endpoint,
                      rdzv_id=rdzv_id(args, run_dir), run_dir=run_dir,
                      preempted_exit_code=args.preempted_exit_code,
                      resume=resume_command(argv, run_dir))
    finally:
        if previous is None:
            os.environ.pop(ENV_RESUME_ARGV, None)
        else:
            os.environ[ENV_RESUME_ARGV] = previous


def _crash_hint(trainer: Trainer) -> None:
    """After a crash (not a crosstrain error) of a run that left checkpoints: the command that resumes it (rank 0
    only)."""
    from crosstrain.checkpoint.manager import step_dirs

    if trainer.run_dir is None or trainer.run is None or not trainer.is_main:
        return
    found = step_dirs(trainer.run_dir / "checkpoints")
    if found:
        print(f"crosstrain: the run stopped with an error; its newest checkpoint is step {found[0][0]}. Resume "
              f"with: {trainer.resume_command()}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from crosstrain.config import load_config

    config = load_config(args.config, _overrides(args))
    argv = _resume_argv(args)
    if args.nproc is not None:
        from crosstrain.config import check_world
        from crosstrain.engine.recipe import resolve_recipe
        from crosstrain.engine.state import new_run_dir

        nnodes = _check_launch(args)
        check_world(config, args.nproc * nnodes)  # fail fast, before any worker starts or file is written
        resolve_recipe(config.train.recipe)
        run_dir = args.run_dir or str(new_run_dir(config.train.output_dir))
        return _launch(args, run_dir, argv)
    import torch

    from crosstrain.engine import Trainer
    from crosstrain.errors import CrosstrainError

    _check_exit_code(args)
    trainer = Trainer(config, run_dir=args.run_dir, resume_argv=argv)
    try:
        summary = trainer.fit()
    except CrosstrainError:
        raise  # one line that names the fix already (a rejected resume must not suggest resuming)
    except torch.OutOfMemoryError as exc:
        from crosstrain.engine.oom import out_of_memory

        raise out_of_memory(exc, config) from None
    except (Exception, KeyboardInterrupt):
        _crash_hint(trainer)
        raise
    if summary and trainer.is_main and not summary.get("already_complete"):  # that case said so itself
        print(f"crosstrain: {'stopped' if summary['preempted'] else 'done'}: {summary['steps']} steps on "
              f"{summary['backend']} x{summary['world_size']}, loss {summary['initial_loss']:.4f} -> "
              f"{summary['final_loss']:.4f}{_eval_part(summary)}, {summary['tokens_per_s']:,.0f} tok/s, "
              f"{summary['wall_s']:.1f} s; "
              f"run dir {summary['run_dir']}", file=sys.stdout, flush=True)
    return args.preempted_exit_code if summary and summary.get("preempted") else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model (the tiny GPT on the embedded corpus by default)",
                       description="Train from a TOML config plus --set overrides; every key has a default.")
    p.add_argument("config", nargs="?", default=None, help="TOML config file (optional)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key, e.g. --set optim.lr=3e-4")
    p.add_argument("--recipe", default=None, metavar="NAME",
                   help="what to train: lm (default) or a plugin's recipe; same as --set train.recipe=NAME")
    p.add_argument("--run-dir", default=None, help="run directory (default: <train.output_dir>/<timestamp>)")
    p.add_argument("--nproc", type=int, default=None, help="start N local worker processes (torchrun's launcher)")
    p.add_argument("--max-restarts", type=int, default=0, help="elastic restarts of the workers (with --nproc)")
    p.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX (with --nproc)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (multi-node, with --nproc)")
    p.add_argument("--rdzv-id", default=None, help="job id every node passes alike (multi-node, with --nproc; "
                   "default: derived from --run-dir)")
    p.add_argument("--preempted-exit-code", type=int, default=0, metavar="N",
                   help="exit N, not 0, when a signal stopped the run early (after its checkpoint), so a scheduler "
                   "that restarts failed jobs restarts it and it resumes (crosstrain k8s passes 143)")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="also name the optimizer step, kernels, compile and layout the defaults chose")
    p.set_defaults(func=run)
