"""Benchmark-task scores of a run's primary model (``eval.tasks``, ``crosstrain eval --tasks``) through the
``crosstrain_score_tasks`` hook: the evaluate plugin runs lm-evaluation-harness in process (extra ``eval``); the
core names no plugin and no task format."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torch import nn

from crosstrain import pluginmanager
from crosstrain.errors import ConfigError

INSTALL = "pip install 'crosstrain[eval]'"


@dataclass(frozen=True)
class TaskRequest:
    """What a task scorer gets: the model (eval mode is its business), its tokenizer metadata
    (:func:`crosstrain.data.hf_tokenizer.describe_tokenizer`), the tasks, the first ``limit`` items of each,
    ``num_fewshot`` (None: each task's own), whether to keep per-item records, and the autocast a forward runs
    under (the run's precision)."""

    model: nn.Module
    tokenizer: dict[str, Any]
    tasks: tuple[str, ...]
    limit: int | None = None
    num_fewshot: int | None = None
    log_samples: bool = False
    autocast: Callable[[], AbstractContextManager[Any]] | None = None


def score_tasks(request: TaskRequest) -> dict[str, Any]:
    """``{"scores": {"<task>/<metric>": value}, "samples": {...}}`` from the first plugin that scores tasks."""
    for _, found in pluginmanager.call_strict("crosstrain_score_tasks", "score its eval tasks", request=request):
        if found is not None:
            return dict(found)
    raise ConfigError(f"no plugin scores eval tasks (lm-evaluation-harness); {INSTALL}")
