"""Slurm's own time-limit signal, end to end (a few minutes, so not in the test suite): on the single-host Slurm of
tests/slurm_cluster.py, ``crosstrain slurm --time 2 --signal-before 59 --submit`` of a long run; Slurm's timer sends
USR1 to the batch shell, the tasks save, the job requeues itself and resumes; the script then stops the second
start with ``scancel --signal=TERM``. Prints what happened, a JSON object on the last line.

    python scripts/slurm_time_limit.py      # needs slurm-wlm and munge (apt-get install slurm-wlm munge)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import slurm_cluster  # noqa: E402

OPTS = ["train.steps=100000", "train.batch_size=4", "train.seq_len=32", "parallel.dp_replicate=2", "backend=cpu",
        "eval.every=0", "checkpoint.every=0", "logging.progress=none", "logging.tensorboard=false"]


def main() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    root = Path(tempfile.mkdtemp(prefix="crosstrain-slurm-limit-"))
    cluster = slurm_cluster.start(root / "slurm", env)
    try:
        folder = root / "job"
        folder.mkdir()
        sets = [a for o in [*OPTS, f"train.output_dir={folder}"] for a in ("--set", o)]
        proc = subprocess.run([sys.executable, "-m", "crosstrain", "slurm", *sets, "--ntasks-per-node", "2",
                               "--time", "2", "--signal-before", "59", "--submit"], cwd=folder, env=cluster.env,
                              capture_output=True, text=True, check=True)
        job = re.search(r"submitted batch job (\d+)", proc.stdout).group(1)
        log = folder / f"slurm-{job}.out"
        first = cluster.wait(job, ("RUNNING",), 300)
        started = time.time()
        print(f"job {job} running since {first['StartTime']}", flush=True)
        resumed = None
        while time.time() - started < 600:
            text = log.read_text() if log.exists() else ""
            resumed = re.search(r"resumed from \S+ at step (\d+)", text)
            if resumed:
                break
            time.sleep(0.5)
        if resumed:  # the second start is past its start-up: stop it with a checkpoint
            cluster.run("scancel", "--signal=TERM", job)
        final = cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED"), 300)
        text = log.read_text()
        print(text[-4000:])
        stops = [int(s) for s in re.findall(r"SIGTERM received; finished step (\d+)", text)]
        signalled = re.search(r"STEP \S+ ON \S+ CANCELLED AT \S+T(\d\d:\d\d:\d\d)", text)
        return {"job": job, "time_limit_s": 120, "signal_before_s": 59, "start": first["StartTime"],
                "first_signal_at": signalled.group(1) if signalled else None,
                "requeued_by_script": "requeueing" in text, "restarts": int(final["Restarts"]),
                "stopped_at_steps": stops, "resumed_at_step": int(resumed.group(1)) if resumed else None,
                "final_state": final["JobState"]}
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(main()))
