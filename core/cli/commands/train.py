"""``crosstrain train [CONFIG] [--set key=value ...] [--run-dir DIR] [--nproc N]``."""

from __future__ import annotations

import argparse
import sys


def _worker_args(args: argparse.Namespace, run_dir: str) -> list[str]:
    out = ["train"]
    if args.config:
        out.append(args.config)
    for item in args.set or []:
        out += ["--set", item]
    out += ["--run-dir", run_dir]
    return out


def run(args: argparse.Namespace) -> int:
    from crosstrain.config import load_config

    config = load_config(args.config, args.set or [])
    if args.nproc:
        from crosstrain.config import check_world
        from crosstrain.engine.state import new_run_dir
        from crosstrain.launch import launch

        nnodes = int(str(args.nnodes).split(":")[-1])
        check_world(config, args.nproc * nnodes)  # fail fast, before any worker starts or file is written
        run_dir = args.run_dir or str(new_run_dir(config.train.output_dir))
        return launch(_worker_args(args, run_dir), nproc=args.nproc, max_restarts=args.max_restarts,
                      nnodes=str(args.nnodes), rdzv_endpoint=args.rdzv_endpoint, run_dir=run_dir)
    from crosstrain.engine import Trainer

    trainer = Trainer(config, run_dir=args.run_dir)
    summary = trainer.fit()
    if summary and trainer.is_main:
        print(f"crosstrain: {'stopped' if summary['preempted'] else 'done'}: {summary['steps']} steps on "
              f"{summary['backend']} x{summary['world_size']}, loss {summary['initial_loss']:.4f} -> "
              f"{summary['final_loss']:.4f}, {summary['tokens_per_s']:,.0f} tok/s, {summary['wall_s']:.1f} s; "
              f"run dir {summary['run_dir']}", file=sys.stdout, flush=True)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model (the tiny GPT on the embedded corpus by default)",
                       description="Train from a TOML config plus --set overrides; every key has a default.")
    p.add_argument("config", nargs="?", default=None, help="TOML config file (optional)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key, e.g. --set optim.lr=3e-4")
    p.add_argument("--run-dir", default=None, help="run directory (default: <train.output_dir>/<timestamp>)")
    p.add_argument("--nproc", type=int, default=0, help="start N local worker processes (torchrun's launcher)")
    p.add_argument("--max-restarts", type=int, default=0, help="elastic restarts of the workers (with --nproc)")
    p.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX (with --nproc)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (multi-node, with --nproc)")
    p.set_defaults(func=run)
