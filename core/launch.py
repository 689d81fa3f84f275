"""``crosstrain train --nproc N``: torch.distributed.run's elastic launcher, in-process.

The workers run ``python -m crosstrain train ...`` (exactly what ``torchrun -m crosstrain train`` runs), all
with the same ``--run-dir`` so an elastic restart (``--max-restarts``) resumes from the run's latest
checkpoint. Multi-node jobs pass ``--nnodes`` and ``--rdzv-endpoint`` as with torchrun; under SLURM, start one
``crosstrain train`` per task with ``srun`` instead (``crosstrain.distenv`` reads the SLURM variables).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from crosstrain.collective import free_port
from crosstrain.errors import ConfigError, CrosstrainError


class LaunchError(CrosstrainError):
    """A worker failed; the exit code is the failing worker's."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def torchrun_args(worker_args: Sequence[str], *, nproc: int, max_restarts: int = 0, nnodes: str = "1",
                  rdzv_endpoint: str | None = None, rdzv_id: str | None = None) -> list[str]:
    """The torchrun command line (without ``torchrun``) that starts ``nproc`` crosstrain workers."""
    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} must be >= 1")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts={max_restarts} must be >= 0")
    endpoint = rdzv_endpoint or f"127.0.0.1:{free_port()}"
    return [
        "--nproc-per-node", str(nproc), "--nnodes", nnodes, "--max-restarts", str(max_restarts),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id or uuid.uuid4().hex[:12],
        "--monitor-interval", "0.5", "--module", "crosstrain", *worker_args,
    ]


def launch(worker_args: Sequence[str], *, nproc: int, max_restarts: int = 0, nnodes: str = "1",
           rdzv_endpoint: str | None = None, run_dir: str | None = None) -> int:
    """Run the elastic agent in this process until the workers finish; returns 0 or raises LaunchError.

    On SIGTERM the agent forwards the signal to the workers (which finish their step, save and exit) and
    waits for them; if ``run_dir``'s summary then says the run was preempted, this returns 0.
    """
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        raise ConfigError("--nproc cannot be used inside a torchrun worker; drop --nproc or torchrun")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(torchrun_args(worker_args, nproc=nproc, max_restarts=max_restarts,
                                                      nnodes=nnodes, rdzv_endpoint=rdzv_endpoint))
    try:
        run(args)
    except SignalException as exc:
        if run_dir and _preempted(Path(run_dir)):
            print(f"crosstrain: launcher got {signal.Signals(exc.sigval).name}; the workers saved a checkpoint "
                  f"in {run_dir} and stopped. Resume with the same command and --run-dir {run_dir}", file=sys.stderr)
            return 0
        raise LaunchError(f"launcher got {signal.Signals(exc.sigval).name} and the workers did not finish cleanly",
                          128 + int(exc.sigval)) from None
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        raise LaunchError(f"worker rank {rank} failed with exit code {failure.exitcode} "
                          f"(after {max_restarts} restart(s) allowed); see its output above", code) from None
    return 0


def _preempted(run_dir: Path) -> bool:
    try:
        return bool(json.loads((run_dir / "summary.json").read_text()).get("preempted"))
    except (OSError, ValueError):
        return False
