"""The command that resumes a run, printed when it stops early (SIGTERM, a crash): the original
``crosstrain`` arguments with ``--run-dir`` set to the run's dir, shell-quoted so it pastes as it is."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence

#: the launcher (``crosstrain train --nproc N``) hands its own arguments to its workers through this variable
#: (JSON list), so the rank that prints the hint names the command the user typed, ``--nproc`` included.
ENV_RESUME_ARGV = "CROSSTRAIN_RESUME_ARGV"

_RUN_DIR = "--run-dir"


def _is_run_dir_flag(token: str) -> bool:
    """``--run-dir`` and the prefixes argparse accepts for it (``--run``, ``--run-d``), with or without ``=``."""
    flag = token.split("=", 1)[0]
    return len(flag) >= len("--ru") and _RUN_DIR.startswith(flag)


def without_run_dir(argv: Sequence[str]) -> list[str]:
    """``argv`` without its ``--run-dir X`` / ``--run-dir=X``."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif _is_run_dir_flag(token):
            skip = "=" not in token
        else:
            out.append(token)
    return out


def resume_command(argv: Sequence[str] | None, run_dir: str | os.PathLike[str]) -> str:
    """``crosstrain ARGV --run-dir RUN_DIR``, shell-quoted. Without ``argv`` (a Trainer built in Python) the
    run's own ``config.toml`` stands for the arguments: it holds the effective configuration."""
    args = without_run_dir(argv) if argv is not None else ["train", os.path.join(str(run_dir), "config.toml")]
    return shlex.join(["crosstrain", *args, _RUN_DIR, str(run_dir)])
