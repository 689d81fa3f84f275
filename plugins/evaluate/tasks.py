"""Score lm-eval tasks on a crosstrain model: task names from lm-eval's registry or local task YAML files, the
results flattened to crosstrain's metric names (``<task>/<metric>``; lm-eval's filter kept as ``,<filter>`` unless
it is ``none``), every problem with the task list one line."""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crosstrain.engine.evaluate_tasks import INSTALL
from crosstrain.errors import ConfigError


def require_lm_eval() -> None:
    """One line (exit 2) when lm-evaluation-harness is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"scoring lm-eval tasks needs lm-evaluation-harness; {INSTALL}")


def is_task_file(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) or "/" in spec


@dataclass
class TaskScores:
    """``scores``: ``{"<task>/<metric>": value}``; ``samples``: lm-eval's per-item records by task (with
    ``log_samples``); ``versions``: each task's version."""

    scores: dict[str, float]
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)


def task_manager(tasks: list[str]) -> Any:
    """lm-eval's TaskManager for ``tasks``: every name must be registered and every YAML path must exist (the
    registry of built-in tasks is indexed only when a name needs it)."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ConfigError("no task given; pass --tasks NAME_OR_YAML[,...] (a task name or a local task YAML file)")
    files = [t for t in tasks if is_task_file(t)]
    for f in files:
        if not Path(f).is_file():
            raise ConfigError(f"task file {f!r} does not exist; pass an lm-eval task YAML path or a registered "
                              "task name")
    names = [t for t in tasks if not is_task_file(t)]
    manager = TaskManager(include_path=sorted({str(Path(f).resolve().parent) for f in files}) or None,
                          include_defaults=bool(names))
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"lm-eval has no task {unknown[0]!r} (`lm-eval ls tasks` lists them); pass a registered "
                          "name or the path of your own task YAML")
    return manager


def flatten(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm-eval's ``results`` (``{task: {"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ...}}``) as
    ``{"<task>/acc": 0.5, "<task>/acc_stderr": 0.1}``; non-numeric values ("N/A") are left out."""
    out: dict[str, float] = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric},{filt}"
            if math.isfinite(float(value)):
                out[f"{task}/{name}"] = float(value)
    return out


def score(lm: Any, tasks: list[str], *, limit: int | None = None, num_fewshot: int | None = None,
          log_samples: bool = False) -> TaskScores:
    """Run ``tasks`` on ``lm`` (an lm-eval ``LM``) with ``lm_eval.simple_evaluate``; ``limit``: the first N items
    of each task."""
    manager = task_manager(tasks)
    from lm_eval import simple_evaluate

    try:
        with _own_rng():
            out = simple_evaluate(model=lm, tasks=list(tasks), limit=limit, num_fewshot=num_fewshot,
                                  task_manager=manager, log_samples=log_samples)
    except (KeyError, FileNotFoundError, ValueError) as exc:  # a task YAML lm-eval cannot build, or its data
        from crosstrain.errors import first_line

        raise ConfigError(f"lm-eval could not load the tasks {','.join(tasks)}: {first_line(exc)}; check the task "
                          "YAML and its data_files") from exc
    assert out is not None  # rank 0 of lm-eval's own world
    samples = {task: [_plain(s) for s in items] for task, items in (out.get("samples") or {}).items()}
    return TaskScores(flatten(out["results"]), samples, dict(out.get("versions") or {}))


def _plain(sample: dict[str, Any]) -> dict[str, Any]:
    """A per-item record: its id, target, the requests' arguments, lm-eval's responses and its metrics."""
    keep = {"doc_id", "target", "arguments", "resps", "filtered_resps", "filter"}
    metrics = sample.get("metrics") or []
    return {**{k: sample[k] for k in keep if k in sample}, **{m: sample[m] for m in metrics if m in sample}}


@contextlib.contextmanager
def _own_rng() -> Iterator[None]:
    """lm-eval seeds Python's, numpy's and torch's global generators (its defaults, for reproducible scores); a
    training run's RNG streams must not move because it was scored, so they are put back afterwards."""
    import random

    import numpy as np
    import torch

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng():  # CPU and every CUDA device
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)
