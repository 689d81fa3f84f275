"""``crosstrain report RUN_DIR [RUN_DIR ...] [--out DIR] [--metric NAME ...]``."""

from __future__ import annotations

import argparse
from typing import Any


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("report", help="write an HTML report with plots of one or more run dirs",
                              description="One self-contained HTML page plus a PNG per plot; several run dirs "
                                          "overlay. Works on a run that is still going (run it again to refresh).")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", "-o", default=None, help="output folder (default: <first RUN_DIR>/report)")
    p.add_argument("--metric", "-m", action="append", default=[], metavar="NAME",
                   help="also plot this metrics.jsonl key against the step (repeatable; a pattern such as "
                        "'rewards/*' plots every match)")
    p.set_defaults(func=_report)
    train = subparsers.choices.get("train")
    if train is not None:  # crosstrain train --profile-steps A:B is --set observability.profile_steps=A:B
        train.add_argument("--profile-steps", action=_AsSet, dest="set", metavar="A:B",
                           help="record a torch.profiler trace of steps A..B on every rank (run dir's profile/)")


class _AsSet(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        setattr(namespace, self.dest, [*items, f"observability.profile_steps={values}"])


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from crosstrain.errors import ConfigError
    from crosstrain.plugins.observability.report import write_report

    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "report"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file; pass a folder (the report is FOLDER/report.html with a PNG "
                          "per plot)")
    path = write_report(args.run_dirs, out, args.metric)
    print(f"crosstrain: report written to {path} (and one PNG per plot in {out})")
    return 0
