"""``crosstrain tune [SPACE] [--trials N] [--jobs K] [--storage URL] [--study NAME] [--out DIR] [--set k=v ...]
[--nproc P] [--json]``, ``crosstrain tune --report DIR``, ``crosstrain tune --throughput`` (docs/tune.md)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from crosstrain.errors import ConfigError


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tune", help="search hyperparameters with Optuna: each trial a crosstrain run",
                              description="Each trial is a `crosstrain train` run in its own run dir under --out; "
                                          "eval values prune trials from rank 0; the study (SQLite in --out by "
                                          "default) survives a kill: the same command resumes it.")
    p.add_argument("space", nargs="?", default=None, metavar="SPACE.toml",
                   help="[tune] settings and [space] keys (default: the example space, see --example)")
    p.add_argument("--trials", type=int, default=8, help="trials the study holds when done (default 8)")
    p.add_argument("--jobs", type=int, default=1, help="trials run at once on this machine (cores split)")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: sqlite:///OUT/tune.db); "
                   "postgresql://, mysql:// or journal:PATH for many workers")
    p.add_argument("--study", default=None, help="study name (default: the space file's name)")
    p.add_argument("--out", default=None, help="folder of the trial run dirs (default: <train.output_dir>/tune)")
    p.add_argument("--config", default=None, help="base training config TOML (default: the defaults)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="base config override, as crosstrain train")
    p.add_argument("--nproc", type=int, default=None, help="worker processes per trial (crosstrain train --nproc)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line (last line)")
    p.add_argument("--example", action="store_true", help="print the example space file and exit")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="write plots of the study in DIR (a tune --out folder) instead of searching")
    p.add_argument("--throughput", action="store_true",
                   help="search the speed knobs that keep the result, maximising tokens/s; prints --set flags")
    p.set_defaults(func=_tune)


def check_extra() -> None:
    if importlib.util.find_spec("optuna") is None:
        raise ConfigError('crosstrain tune needs optuna (not installed); run: pip install "crosstrain[tune]"')


def _tune(args: argparse.Namespace) -> int:
    others = [flag for flag, given in (("SPACE", args.space), ("--report", args.report),
                                       ("--throughput", args.throughput)) if given]
    if args.example and others:
        raise ConfigError(f"--example only prints the example space file; drop {' and '.join(others)} (or run "
                          "without --example)")
    if args.report is not None and args.throughput:
        raise ConfigError("--report writes a finished search's plots and --throughput runs a search; pass one")
    if args.example:
        from importlib import resources

        from crosstrain.plugins.tune.space import EXAMPLE

        sys.stdout.write(resources.files("crosstrain.plugins.tune").joinpath(EXAMPLE).read_text())
        return 0
    check_extra()
    if args.report is not None:
        from crosstrain.plugins.tune.report import write_report

        out = write_report(args.report, storage=args.storage, study=args.study)
        print(f"crosstrain tune: report written to {out}")
        return 0
    if args.throughput:
        from crosstrain.plugins.tune.throughput import run_throughput

        found = run_throughput(sets=args.set or [], config_path=args.config, out=args.out, nproc=args.nproc)
        _print(found, args.json)
        return 0
    from crosstrain.plugins.tune.space import read_space

    settings, params, name = read_space(args.space)
    common = dict(sets=args.set or [], config_path=args.config, out=args.out, storage=args.storage,
                  study=args.study, trials=args.trials, jobs=args.jobs, nproc=args.nproc)
    if settings.strategy == "pbt":
        from crosstrain.plugins.tune.pbt import run_pbt

        _print(run_pbt(settings, params, name, **common), args.json)
        return 0
    from crosstrain.plugins.tune import search

    found = search.run(search.prepare(settings, params, name, **common))
    _print(found, args.json)
    return 0 if found["complete"] or found["pruned"] else 1


def _print(found: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(found), flush=True)
        return
    for key, value in found.items():
        print(f"{key}: {value}")
