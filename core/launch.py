"""``crosstrain train --nproc N``: torch.distributed.run's elastic launcher, in-process.

The workers run ``python -m crosstrain train ...`` (exactly what ``torchrun -m crosstrain train`` runs), all
with the same ``--run-dir`` so an elastic restart (``--max-restarts``) resumes from the run's latest
checkpoint. Multi-node jobs pass ``--nnodes`` and ``--rdzv-endpoint`` as with torchrun; under SLURM, start one
``crosstrain train`` per task with ``srun`` instead (``crosstrain.distenv`` reads the SLURM variables).

The job is one unit: the launcher holds the run dir's lock (:mod:`crosstrain.runlock`) for its workers, the
workers die with it (:mod:`crosstrain.parentwatch`), and torchelastic's log folder is one of ours in the temp dir,
removed when the job ends; one left by a launcher killed with SIGKILL is removed by the next launch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from crosstrain.collective import free_port
from crosstrain.errors import ConfigError, CrosstrainError
from crosstrain.fault.peer_loss import first_cause
from crosstrain.parentwatch import ENV_LAUNCHER_PID
from crosstrain.runlock import lock_dir, pid_alive

#: torchelastic's per-job log folder: ``<temp dir>/crosstrain-launch-<launcher pid>-<random>``.
LOG_DIR_PREFIX = "crosstrain-launch-"
_LOG_DIR_RE = re.compile(rf"^{LOG_DIR_PREFIX}(\d+)-")


class LaunchError(CrosstrainError):
    """A worker failed; the exit code is the failing worker's."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def torchrun_args(worker_args: Sequence[str], *, nproc: int, max_restarts: int = 0, nnodes: str = "1",
                  rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                  log_dir: str | None = None) -> list[str]:
    """The torchrun command line (without ``torchrun``) that starts ``nproc`` crosstrain workers."""
    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} must be >= 1")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts={max_restarts} must be >= 0")
    endpoint = rdzv_endpoint or f"127.0.0.1:{free_port()}"
    return [
        "--nproc-per-node", str(nproc), "--nnodes", nnodes, "--max-restarts", str(max_restarts),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id or uuid.uuid4().hex[:12],
        "--monitor-interval", "0.5", *(["--log-dir", log_dir] if log_dir else []), "--module", "crosstrain",
        *worker_args,
    ]


def launch(worker_args: Sequence[str], *, nproc: int, max_restarts: int = 0, nnodes: str = "1",
           rdzv_endpoint: str | None = None, rdzv_id: str | None = None, run_dir: str | None = None,
           resume: str | None = None, preempted_exit_code: int = 0) -> int:
    """Run the elastic agent in this process until the workers finish; returns 0 or raises LaunchError.

    On SIGTERM the agent forwards the signal to the workers (which finish their step, save and exit) and
    waits for them; if ``run_dir``'s summary then says the run was preempted, this prints ``resume`` (the
    command that resumes) and returns ``preempted_exit_code``. Workers that stopped by the vote after another
    node's signal exit with that code too (non-zero: they fail, so a scheduler restarts them). Every node of a
    multi-node job must pass the same ``rdzv_id`` (c10d keys its rendezvous by it); one node alone may leave it to
    a random one.
    """
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        raise ConfigError("--nproc cannot be used inside a torchrun worker; drop --nproc or torchrun")
    from torch.distributed.run import get_args_parser, run

    # one node: this launcher holds the run-dir lock for its workers; several: the rank-0 worker holds it itself
    with _job(run_dir if nnodes in ("1", "1:1") else None) as log_dir:
        args = get_args_parser().parse_args(torchrun_args(worker_args, nproc=nproc, max_restarts=max_restarts,
                                                          nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
                                                          rdzv_id=rdzv_id, log_dir=log_dir))
        return _run(run, args, max_restarts=max_restarts, run_dir=run_dir, resume=resume,
                    preempted_exit_code=preempted_exit_code)


def _run(run: Callable[[Any], Any], args: Any, *, max_restarts: int, run_dir: str | None,
         resume: str | None = None, preempted_exit_code: int = 0) -> int:
    """torchrun's ``run(args)``, its failures turned into :class:`LaunchError` (or ``preempted_exit_code`` for a
    preempted job)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run(args)
    except SignalException as exc:
        if run_dir and _preempted(Path(run_dir)):
            print(f"crosstrain: launcher got {signal.Signals(exc.sigval).name}; the workers saved a checkpoint "
                  f"in {run_dir} and stopped. Resume with: {resume or f'the same command and --run-dir {run_dir}'}",
                  file=sys.stderr)
            return preempted_exit_code
        raise LaunchError(f"launcher got {signal.Signals(exc.sigval).name} and the workers did not finish cleanly",
                          128 + int(exc.sigval)) from None
    except ChildFailedError as exc:
        rank = first_cause({r: (f.timestamp, f.exitcode) for r, f in exc.failures.items()})
        failure = exc.failures[rank]
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        if preempted_exit_code and code == preempted_exit_code:
            raise LaunchError(f"the workers stopped after a signal (here or on another node), saved a checkpoint in "
                              f"{run_dir} and exited {code}; resume with: "
                              f"{resume or f'the same command and --run-dir {run_dir}'}", code) from None
        raise LaunchError(f"worker rank {rank} failed with exit code {failure.exitcode} "
                          f"(after {max_restarts} restart(s) allowed); see its output above", code) from None
    return 0


@contextmanager
def _job(run_dir: str | None) -> Iterator[str]:
    """For the job's lifetime: the run-dir lock, ``$CROSSTRAIN_LAUNCHER_PID`` for the workers and a log folder."""
    remove_stale_log_dirs()
    lock = lock_dir(run_dir) if run_dir else None
    previous = os.environ.get(ENV_LAUNCHER_PID)
    os.environ[ENV_LAUNCHER_PID] = str(os.getpid())
    log_dir = tempfile.mkdtemp(prefix=f"{LOG_DIR_PREFIX}{os.getpid()}-")
    try:
        yield log_dir
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
        if previous is None:
            os.environ.pop(ENV_LAUNCHER_PID, None)
        else:
            os.environ[ENV_LAUNCHER_PID] = previous
        if lock is not None:
            lock.release()  # also removes the run dir it created if the workers wrote nothing (they failed early)


def remove_stale_log_dirs(root: str | None = None) -> list[Path]:
    """Remove the log folders of launchers that are gone (killed with SIGKILL, so they could not); returns them."""
    removed: list[Path] = []
    base = Path(root or tempfile.gettempdir())
    try:
        children = list(base.iterdir())
    except OSError:
        return removed
    for child in children:
        m = _LOG_DIR_RE.match(child.name)
        if m and child.is_dir() and not pid_alive(int(m.group(1))):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def _preempted(run_dir: Path) -> bool:
    try:
        return bool(json.loads((run_dir / "summary.json").read_text()).get("preempted"))
    except (OSError, ValueError):
        return False
