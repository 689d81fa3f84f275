"""``crosstrain slurm [CONFIG] --nodes N --ntasks-per-node M [--time T] [--partition P] [--submit]``."""

from __future__ import annotations

import argparse
import os
import sys


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from crosstrain.cli.commands.train import _overrides
    from crosstrain.config import check_world, load_config
    from crosstrain.engine.recipe import resolve_recipe
    from crosstrain.errors import ConfigError
    from crosstrain.slurm import SlurmJob, check_job, render, sbatch, submit

    config = load_config(args.config, _overrides(args))
    output_dir = Path(config.train.output_dir).absolute()
    job = SlurmJob(nodes=args.nodes, ntasks_per_node=args.ntasks_per_node,
                   run_dir=str(Path(args.run_dir).absolute()) if args.run_dir
                   else str(output_dir / "slurm-$SLURM_JOB_ID"),
                   log=str(output_dir / "slurm-%j.out"), workdir=os.getcwd(), job_name=args.job_name,
                   time=args.time, partition=args.partition, signal_before_s=args.signal_before, port=args.port,
                   sbatch_args=tuple(args.sbatch_arg or ()))
    # every check before anything is written: the job, the config for its world size, the recipe, sbatch itself
    check_job(job)
    check_world(config, job.nodes * job.ntasks_per_node)
    resolve_recipe(config.train.recipe)
    if args.submit:
        sbatch()
    script = Path(args.script).absolute() if args.script else output_dir / f"{job.job_name}.sbatch"
    if script.is_dir():
        raise ConfigError(f"--script {str(script)!r} is a folder; name a file")
    train_argv = ["train", *([str(Path(args.config).absolute())] if args.config else [])]
    for item in _overrides(args):
        train_argv += ["--set", item]
    created = [p for p in (output_dir, script.parent) if not p.exists()]
    output_dir.mkdir(parents=True, exist_ok=True)  # sbatch opens the log there before the job starts
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(render(job, train_argv, sys.executable))
    if not args.submit:
        print(f"crosstrain: wrote {script}; submit it with: sbatch {script}")
        return 0
    try:
        job_id = submit(script)
    except ConfigError:  # refused (an unknown partition, too many nodes): leave nothing behind
        script.unlink()
        for folder in reversed(created):
            _remove_if_empty(folder)
        raise
    print(f"crosstrain: submitted batch job {job_id} ({script}); run dir "
          f"{job.run_dir.replace('$SLURM_JOB_ID', job_id)}, log {job.log.replace('%j', job_id)}")
    return 0


def _remove_if_empty(folder: object) -> None:
    try:
        os.rmdir(str(folder))
    except OSError:
        pass


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slurm", help="write (and submit) the sbatch script that trains a config on Slurm",
                       description="Write an sbatch script that starts one `crosstrain train` per task with srun; "
                       "it checkpoints and requeues before the time limit and resumes in the same run dir.")
    p.add_argument("config", nargs="?", default=None, help="TOML config file (optional)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key, e.g. --set optim.lr=3e-4")
    p.add_argument("--recipe", default=None, metavar="NAME", help="same as --set train.recipe=NAME")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--ntasks-per-node", type=int, default=1, help="tasks (ranks) per node, one per device")
    p.add_argument("--time", default=None, help="time limit, as sbatch --time (30, 1:30:00, 2-00:00:00)")
    p.add_argument("--partition", default=None, help="partition (default: the cluster's default)")
    p.add_argument("--signal-before", type=int, default=120, metavar="S",
                   help="seconds before the time limit to checkpoint and requeue (default 120)")
    p.add_argument("--job-name", default="crosstrain", help="job name; also the script's file name")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: 12000 + job id %% 20000)")
    p.add_argument("--run-dir", default=None,
                   help="run directory (default: <train.output_dir>/slurm-<job id>, kept across requeues)")
    p.add_argument("--script", default=None, help="where to write the script (default: <train.output_dir>/<job "
                   "name>.sbatch)")
    p.add_argument("--sbatch-arg", action="append", metavar="--OPTION=VALUE",
                   help="another sbatch option for the script, e.g. --sbatch-arg=--account=proj (repeatable)")
    p.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    p.set_defaults(func=run)
