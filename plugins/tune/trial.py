"""One trial: a real ``crosstrain train`` run in its own run dir, started by the tuner and dying with it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crosstrain.parentwatch import ENV_LAUNCHER_PID
from crosstrain.plugins.tune.space import as_set


@dataclass(frozen=True)
class TrialCommand:
    """What every trial of a search shares: the base ``--set`` items, layout and where eval values go."""

    base_sets: tuple[str, ...]
    config_path: str | None
    nproc: int | None
    threads: int
    storage: str
    study: str
    intermediate: str
    pruner: tuple[str, int, int] = ("none", 0, 0)  # name, startup trials, warmup steps

    def argv(self, run_dir: Path, params: dict[str, Any], trial_id: int, extra: tuple[str, ...] = ()) -> list[str]:
        sets = [*self.base_sets, *(as_set(k, v) for k, v in params.items()), *extra,
                f"tune.storage={self.storage}", f"tune.study={self.study}", f"tune.trial={trial_id}",
                f"tune.intermediate={self.intermediate}", f"tune.pruner={self.pruner[0]}",
                f"tune.startup_trials={self.pruner[1]}", f"tune.warmup_steps={self.pruner[2]}"]
        if self.threads and not any(s.startswith("train.threads=") for s in self.base_sets):
            sets.append(f"train.threads={self.threads}")
        argv = [sys.executable, "-m", "crosstrain", "train", *([self.config_path] if self.config_path else [])]
        for item in sets:
            argv += ["--set", item]
        argv += ["--run-dir", str(run_dir)]
        if self.nproc:
            argv += ["--nproc", str(self.nproc)]
        return argv

    def run(self, run_dir: Path, params: dict[str, Any], trial_id: int, extra: tuple[str, ...] = (),
            running: set[subprocess.Popen] | None = None) -> int:
        """Train to the end (or until pruned); the exit code. The child arms :mod:`crosstrain.parentwatch`
        against this process, so a tuner killed with SIGKILL takes its trial (and that trial's workers) along;
        ``running`` holds the child while it runs (the tuner forwards SIGTERM to it)."""
        env = dict(os.environ)
        env[ENV_LAUNCHER_PID] = str(os.getpid())
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "tune_trial.log", "ab") as log:
            proc = subprocess.Popen(self.argv(run_dir, params, trial_id, extra), env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT)
            if running is not None:
                running.add(proc)
            try:
                return proc.wait()
            finally:
                if running is not None:
                    running.discard(proc)


def read_summary(run_dir: Path) -> dict[str, Any]:
    try:
        value = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def metric_value(run_dir: Path, metric: str, summary: dict[str, Any]) -> float | None:
    """``metric`` from summary.json, else (``eval_<name>``) the last ``eval/<name>`` in metrics.jsonl."""
    value = summary.get(metric)
    if value is None and metric.startswith("eval_"):
        value = last_metric(run_dir, "eval/" + metric[len("eval_"):])
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def last_metric(run_dir: Path, key: str) -> float | None:
    found = None
    try:
        with open(run_dir / "metrics.jsonl") as f:
            for line in f:
                if key in line:
                    found = json.loads(line).get(key, found)
    except (OSError, ValueError):
        return None
    return found


def last_line(run_dir: Path) -> str:
    """The trial's last output line (its error, when it failed)."""
    try:
        lines = (run_dir / "tune_trial.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""
