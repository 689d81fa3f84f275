"""The two configs of a search: ``[tune]`` of a trial's run (where its eval values go) and a space file's
``[tune]`` table (how the search runs)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TuneRunSection(BaseModel):
    """``[tune]`` in a run's config: set by ``crosstrain tune`` on each trial, off (``trial = -1``) otherwise.

    Rank 0 reports ``intermediate`` from each evaluation to trial ``trial`` of ``study`` in ``storage`` and asks
    the study's pruner whether to stop (docs/tune.md)."""

    model_config = ConfigDict(extra="forbid")

    storage: str = Field(default="", description="the study's Optuna storage URL")
    study: str = Field(default="", description="the study's name")
    trial: int = Field(default=-1, ge=-1, description="Optuna trial id this run is (-1: not a trial)")
    intermediate: str = Field(default="eval/loss", description="the step metric reported as intermediate value")
    pruner: Literal["none", "median", "hyperband", "asha"] = Field(default="none", description="the search's pruner "
                                                                   "(Optuna does not store it with the study)")
    startup_trials: int = Field(default=2, ge=0, description="median pruner: trials that are never pruned")
    warmup_steps: int = Field(default=0, ge=0, description="median pruner: no pruning before this step")


class SearchSettings(BaseModel):
    """A space file's ``[tune]`` table."""

    model_config = ConfigDict(extra="forbid")

    metric: str = Field(default="eval_loss", description="a summary.json key; eval_* also gives intermediate values")
    direction: Literal["minimize", "maximize"] = "minimize"
    pruner: Literal["none", "median", "hyperband", "asha"] = "median"
    sampler: Literal["tpe", "random", "cmaes", "grid"] = "tpe"
    seed: int = Field(default=0, ge=0)
    startup_trials: int = Field(default=2, ge=0, description="median pruner: trials that are never pruned")
    warmup_steps: int = Field(default=0, ge=0, description="median pruner: no pruning before this step")
    base_first: bool = Field(default=True, description="the first trial is the base config (when it lies in the "
                             "space), so the best is never worse than it")
    retries: int = Field(default=2, ge=0, description="a trial that failed because of its machine (no disk space, "
                         "killed by a signal, a lost rank) is run again with its parameters up to this many times "
                         "per tuner run, and does not count among --trials; 0: such a trial is an ordinary failure")
    heartbeat: int = Field(default=30, ge=1, description="on a PostgreSQL or MySQL storage: seconds between a "
                           "running trial's heartbeats; a trial silent for twice as long is taken over by another "
                           "tuner")
    strategy: Literal["optuna", "pbt"] = "optuna"
    population: int = Field(default=4, ge=2, description="pbt: members trained together")
    rounds: int = Field(default=3, ge=1, description="pbt: rounds; train.steps is split evenly between them")
    perturb: float = Field(default=1.25, gt=1, description="pbt explore: a numeric value is multiplied or divided "
                           "by this")
