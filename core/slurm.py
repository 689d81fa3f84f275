"""``crosstrain slurm``: the sbatch script that trains a config as one Slurm job, and its submission.

The script starts one ``crosstrain train`` per task with ``srun`` (:mod:`crosstrain.distenv` reads SLURM's
variables); the rendezvous is the first host of ``SLURM_JOB_NODELIST`` (its ``NodeAddr``) on a port fixed per job.
Every start of the job, a requeue included, trains in the same run dir (``slurm-$SLURM_JOB_ID`` by default, the job
id survives a requeue), so ``checkpoint.resume = "auto"`` continues from its newest checkpoint.

Stopping: ``--signal=B:USR1@S`` has Slurm signal the batch shell S seconds before the time limit; the shell sends
SIGTERM to the tasks (they finish the step, save and exit 0, :mod:`crosstrain.engine.preemption`) and then
requeues the job. ``scancel --signal=TERM JOB`` signals the tasks only: they save and the job ends, to be continued
with ``scontrol requeue JOB``. Slurm's own preemption (``PreemptMode=REQUEUE``) sends SIGTERM and requeues itself.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from crosstrain.errors import ConfigError, CrosstrainError

#: Slurm's ``--signal=...@S`` takes at most this many seconds
MAX_SIGNAL_S = 65535
#: Slurm may send the ``--signal`` up to this much earlier than asked (sbatch(1)); a signal that comes while the
#: tasks still start up stops them before they can save
SIGNAL_EARLY_S = 60
#: the default port of the rendezvous: this plus the job id modulo PORT_SPAN, so two jobs on one node differ;
#: 12000..31999 stays below Linux's default ephemeral range (32768-60999), which outgoing connections draw from
PORT_BASE, PORT_SPAN = 12000, 20000

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Slurm's time formats (sbatch(1) --time): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$")


@dataclass(frozen=True)
class SlurmJob:
    """What the sbatch script asks Slurm for and where the run lives."""

    nodes: int
    ntasks_per_node: int
    run_dir: str  # absolute; may hold ``$SLURM_JOB_ID``
    log: str  # absolute; sbatch's ``%j`` pattern
    workdir: str
    job_name: str = "crosstrain"
    time: str | None = None
    partition: str | None = None
    signal_before_s: int = 120
    port: int | None = None
    sbatch_args: tuple[str, ...] = field(default_factory=tuple)


def time_limit_s(value: str) -> int:
    """Seconds of a Slurm time limit (``30``, ``1:30:00``, ``2-00:00``); a ConfigError names the formats."""
    m = _TIME.match(value.strip())
    seconds = 0
    if m:
        d, dh, dm, ds, mm, ms, hs = (int(g) if g else 0 for g in m.groups())
        if m.group(1) is not None:  # D-H[:M[:S]]
            seconds = ((d * 24 + dh) * 60 + dm) * 60 + ds
        elif m.group(7) is not None:  # H:M:S
            seconds = (mm * 60 + ms) * 60 + hs
        else:  # M or M:S
            seconds = mm * 60 + ms
    if seconds <= 0:
        raise ConfigError(f"--time={value!r} is not a Slurm time limit; use minutes (30), H:M:S (1:30:00) or "
                          "D-H:M:S (2-00:00:00)")
    return seconds


def check_job(job: SlurmJob) -> None:
    """One-line ConfigErrors for what Slurm would refuse or what could not work, before anything is written."""
    if job.nodes < 1:
        raise ConfigError(f"--nodes={job.nodes} must be >= 1")
    if job.ntasks_per_node < 1:
        raise ConfigError(f"--ntasks-per-node={job.ntasks_per_node} must be >= 1 (one task per device)")
    if not _NAME.match(job.job_name):
        raise ConfigError(f"--job-name={job.job_name!r} must be letters, digits, '.', '_' or '-'")
    if job.partition is not None and not _NAME.match(job.partition):
        raise ConfigError(f"--partition={job.partition!r} must be letters, digits, '.', '_' or '-'")
    if not 1 <= job.signal_before_s <= MAX_SIGNAL_S:
        raise ConfigError(f"--signal-before={job.signal_before_s} must be 1..{MAX_SIGNAL_S} seconds")
    if job.time is not None:
        limit = time_limit_s(job.time)
        if limit - job.signal_before_s <= SIGNAL_EARLY_S:
            raise ConfigError(f"--signal-before={job.signal_before_s} s leaves {limit - job.signal_before_s} s of "
                              f"--time={job.time} ({limit} s) and Slurm may signal up to {SIGNAL_EARLY_S} s early, "
                              "before the tasks have started; lower --signal-before or raise --time")
    for flag, path in (("train.output_dir", job.log), ("the working directory", job.workdir)):
        if any(ch.isspace() for ch in path):
            raise ConfigError(f"{flag} {path!r} holds whitespace, which an #SBATCH line cannot carry; use a path "
                              "without spaces")
    if job.port is not None and not 1024 <= job.port <= 65535:
        raise ConfigError(f"--port={job.port} must be 1024..65535 (omit it to derive one from the job id)")
    for arg in job.sbatch_args:
        if not arg.startswith("--") or "\n" in arg or arg.split("=", 1)[0] in _OWN_FLAGS:
            raise ConfigError(f"--sbatch-arg={arg!r} must be one sbatch option such as --account=NAME that "
                              f"crosstrain does not set itself ({', '.join(sorted(_OWN_FLAGS))})")


_OWN_FLAGS = frozenset({"--nodes", "--ntasks-per-node", "--time", "--partition", "--signal", "--requeue",
                        "--no-requeue", "--output", "--open-mode", "--chdir", "--job-name"})


def render(job: SlurmJob, train_argv: Sequence[str], python: str) -> str:
    """The sbatch script: ``srun PYTHON -m crosstrain TRAIN_ARGV --run-dir RUN_DIR`` with the rendezvous and the
    signal handling described in the module docstring. ``train_argv`` starts with ``train``."""
    q = shlex.quote
    directives = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", f"--ntasks-per-node={job.ntasks_per_node}",
                  *([f"--time={job.time}"] if job.time else []),
                  *([f"--partition={job.partition}"] if job.partition else []),
                  f"--signal=B:USR1@{job.signal_before_s}", "--requeue", "--open-mode=append",
                  f"--output={job.log}", f"--chdir={job.workdir}", *job.sbatch_args]
    port = str(job.port) if job.port else f"$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))"
    # $SLURM_JOB_ID stays unquoted so the shell expands it; the rest of the path is quoted
    run_dir = '"$SLURM_JOB_ID"'.join(q(part) if part else "" for part in job.run_dir.split("$SLURM_JOB_ID"))
    train = " ".join(q(a) for a in [python, "-m", "crosstrain", *train_argv])
    lines = [
        "#!/bin/bash",
        "# written by `crosstrain slurm`; every start of this job (a requeue too) trains in the same run dir",
        *(f"#SBATCH {d}" for d in directives),
        "set -u",
        "# torchrun's variables from the submitting shell would win over SLURM's (crosstrain.distenv reads them first)",
        "unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT",
        'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "# the node's address, which differs from its name where slurm.conf sets NodeAddr",
        'addr=$(scontrol -o show node "$first" | tr " " "\\n" | sed -n "s/^NodeAddr=//p")',
        'export MASTER_ADDR="${addr:-$first}"',
        f"export MASTER_PORT={port}",
        f"run_dir={run_dir}",
        'echo "crosstrain slurm: job $SLURM_JOB_ID start ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST,'
        ' rendezvous $MASTER_ADDR:$MASTER_PORT, run dir $run_dir"',
        "requeue=0 trapped=0",
        f"# USR1 comes {job.signal_before_s} s before the time limit (--signal): the tasks get SIGTERM, finish their "
        "step and save; then the job is requeued and resumes",
        "trap 'requeue=1 trapped=1; scancel --signal=TERM \"$SLURM_JOB_ID\"' USR1",
        f'srun --kill-on-bad-exit=1 {train} --run-dir "$run_dir" &',
        "step=$!",
        'wait "$step"; rc=$?',
        '# a trapped signal ends `wait` early (status > 128): wait again for the status of srun itself',
        'while [ "$rc" -gt 128 ] && [ "$trapped" = 1 ]; do trapped=0; wait "$step"; rc=$?; done',
        'if [ "$requeue" = 1 ]; then',
        '  echo "crosstrain slurm: time limit near, srun exited $rc; requeueing to resume from the newest checkpoint'
        ' in $run_dir"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def sbatch() -> str:
    """The path of ``sbatch``; a ConfigError when it is not on PATH."""
    found = shutil.which("sbatch")
    if found is None:
        raise ConfigError("sbatch is not on PATH; install Slurm's client commands or drop --submit")
    return found


def submit(script: Path) -> str:
    """``sbatch --parsable SCRIPT``; returns the job id. A refusal is a one-line ConfigError with sbatch's reason."""
    proc = subprocess.run([sbatch(), "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        reason = next((line for line in proc.stderr.splitlines() if line.strip()), f"exit {proc.returncode}")
        raise ConfigError(f"sbatch refused the job: {reason.strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise CrosstrainError(f"sbatch answered {proc.stdout.strip()!r}, not a job id")
    return job_id
