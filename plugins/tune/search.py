"""``crosstrain tune``'s search: check everything, then K workers take trials (new ones, or ones a dead tuner
left RUNNING) until the study holds N, each trial a ``crosstrain train`` run told to Optuna when it ends."""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crosstrain.errors import ConfigError
from crosstrain.plugins.tune.config import SearchSettings
from crosstrain.plugins.tune.pruning import PRUNED_AT
from crosstrain.plugins.tune.space import Param, base_value, check_keys
from crosstrain.plugins.tune.trial import TrialCommand, last_line, metric_value, read_summary

#: numeric summary.json keys every run writes (crosstrain.engine.summary.build_summary)
SUMMARY_KEYS = ("final_loss", "initial_loss", "tokens_per_s", "mfu", "peak_memory_bytes", "median_step_time_s",
                "wall_s", "compile_s", "nonfinite_steps", "eval_loss", "best_eval_loss")


@dataclass
class Search:
    """Everything a worker needs, checked before any trial starts."""

    settings: SearchSettings
    params: list[Param]
    study_name: str
    storage_url: str
    out: Path
    trials: int
    jobs: int
    command: TrialCommand
    base: Any
    enqueue: dict[str, Any] | None
    record: dict[str, Any]
    storage_given: bool
    errors: list[BaseException] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    running: set[Any] = field(default_factory=set)
    attempts: dict[int, int] = field(default_factory=dict)  # environment failures in this run, by first trial

    def stop(self, *_: Any) -> None:
        """SIGTERM or Ctrl-C: each running trial saves a checkpoint and exits (crosstrain's preemption), nothing
        more is started and nothing is told, so the same command resumes those trials."""
        self.stopping.set()
        for proc in list(self.running):
            proc.send_signal(signal.SIGTERM)


def check_metric(settings: SearchSettings, base: Any) -> None:
    """A metric no run of this config reports, or a pruner without intermediate values: one line, exit 2."""
    metric = settings.metric
    if metric.startswith("eval_") or metric == "best_eval_loss":
        if not base.eval.every:
            raise ConfigError(f"metric {metric!r} is reported only by runs that evaluate; pass --set eval.every=N "
                              "(e.g. 20)")
    elif metric not in SUMMARY_KEYS and metric not in _recipe_keys(base):
        raise ConfigError(f"metric {metric!r} is not a key any run reports in summary.json; use one of "
                          f"{', '.join(SUMMARY_KEYS)}, eval_<metric> or a key of the recipe's summary")
    if settings.pruner != "none" and not metric.startswith("eval_"):
        raise ConfigError(f"pruner = {settings.pruner!r} needs intermediate values, which only eval_* metrics have; "
                          "set pruner = 'none' or metric = 'eval_loss'")


def _recipe_keys(base: Any) -> set[str]:
    from crosstrain.engine.recipe import resolve_recipe

    try:
        return set(resolve_recipe(base.train.recipe).summary())
    except Exception:  # a recipe whose summary needs a built run: its keys are unknown before training
        return set()


def prepare(settings: SearchSettings, params: list[Param], name: str, *, sets: list[str], config_path: str | None,
            out: str | None, storage: str | None, study: str | None, trials: int, jobs: int,
            nproc: int | None) -> Search:
    """Every check that can fail on input, before the study or any run dir exists."""
    from crosstrain.plugins.tune.record import describe
    from crosstrain.plugins.tune.storage import check_url
    from crosstrain.plugins.tune.study import default_storage

    if trials < 1:
        raise ConfigError(f"--trials={trials} must be >= 1")
    if jobs < 1:
        raise ConfigError(f"--jobs={jobs} must be >= 1")
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc={nproc} must be >= 1")
    base = check_keys(params, sets, config_path)
    check_metric(settings, base)
    from crosstrain.plugins.tune.study import make_sampler

    make_sampler(settings, params)  # a grid over a continuous range, a missing cmaes: refused before anything exists
    sets = list(sets)
    # a trial killed with its tuner resumes from its last evaluation, unless checkpoint.every was set on purpose
    if not base.checkpoint.every or "every" not in base.checkpoint.model_fields_set:
        sets.append(f"checkpoint.every={base.eval.every or max(1, base.train.steps // 4)}")
    out_dir = Path(out) if out else Path(base.train.output_dir) / "tune"
    if out_dir.is_file():
        raise ConfigError(f"--out {str(out_dir)!r} is a file; pass a folder")
    url = storage or default_storage(out_dir)
    check_url(url, given=storage is not None)
    # K trials at once share the cores; one trial keeps train.threads as configured (auto by default), so trial 0
    # trains exactly what `crosstrain train` with the same --set does
    threads = max(1, (os.cpu_count() or 1) // (jobs * (nproc or 1))) if jobs > 1 else 0
    command = TrialCommand(tuple(sets), config_path, nproc, threads, url, study or name,
                           "eval/" + settings.metric[len("eval_"):] if settings.metric.startswith("eval_") else "",
                           (settings.pruner, settings.startup_trials, settings.warmup_steps))
    values = {p.key: base_value(base, p.key) for p in params}
    # the grid sampler would draw the base point again; other samplers learn from it like any trial
    first = settings.base_first and settings.sampler != "grid" and all(p.contains(values[p.key]) for p in params)
    enqueue = values if first else None
    return Search(settings, params, study or name, url, out_dir, trials, jobs, command, base, enqueue,
                  describe(settings, params, base), storage is not None)


def run(search: Search, log: Any = None) -> dict[str, Any]:
    """Run the search to N trials in the study (progress lines to ``log``, default the current ``sys.stderr``);
    returns the result line's fields."""
    import optuna

    log = sys.stderr if log is None else log  # looked up per call: a default argument would keep the stderr of import

    from crosstrain.plugins.tune.study import load_study, open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not search.storage_given:
        search.out.mkdir(parents=True, exist_ok=True)  # the study database is in it
    # a storage outside --out is opened and its study checked before --out exists
    storage = open_storage(search.storage_url, search.storage_given, heartbeat=search.settings.heartbeat)
    cfg = search.base
    study = load_study(search.study_name, storage, search.settings, search.params, cfg.train.steps,
                       cfg.eval.every or cfg.train.steps, search.record)
    search.out.mkdir(parents=True, exist_ok=True)
    workers = [threading.Thread(target=_worker, args=(search, study, storage, log), name=f"tune-job-{i}")
               for i in range(search.jobs)]
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, search.stop) if main else None
    try:
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            try:
                for w in workers:
                    w.join(timeout=0.5)
            except KeyboardInterrupt:
                search.stop()
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    if search.errors:
        raise search.errors[0]
    if search.stopping.is_set():
        print("crosstrain tune: stopped; the running trials saved a checkpoint. Run the same command to resume them",
              file=log, flush=True)
    return result(study, search.storage_url)


def _worker(search: Search, study: Any, storage: Any, log: Any) -> None:
    from crosstrain.plugins.tune.study import WAIT, take_next

    told_waiting = False
    try:
        while not search.stopping.is_set() and not search.errors:
            got = take_next(study, storage, search.out, search.trials, search.enqueue, search.settings,
                            search.params, local=not search.storage_given)
            if got is None:
                return
            if got == WAIT:
                if not told_waiting:
                    print(f"crosstrain tune: all {search.trials} trials taken; waiting for the running ones (a "
                          "trial whose tuner stops sending heartbeats is taken over)", file=log, flush=True)
                    told_waiting = True
                search.stopping.wait(search.settings.heartbeat)
                continue
            try:
                _run_trial(search, study, storage, got.trial, got.params, got.how, log)
            finally:
                got.release()
    except BaseException as exc:  # the first error ends the search once the other workers finish their trial
        search.errors.append(exc)


def _run_trial(search: Search, study: Any, storage: Any, trial: Any, params: dict[str, Any], how: str,
               log: Any) -> None:
    from optuna.trial import TrialState

    run_dir = Path(trial.user_attrs["run_dir"])
    pruned_at = storage.get_trial(trial._trial_id).user_attrs.get(PRUNED_AT)
    print(f"crosstrain tune: {how} trial {trial.number} {params} in {run_dir}", file=log, flush=True)
    if pruned_at is None:
        try:
            code: int | None = search.command.run(run_dir, params, trial._trial_id, running=search.running)
            line = last_line(run_dir)
        except OSError as exc:  # the tuner could not start it: its run dir or log cannot be written
            code, line = None, f"{type(exc).__name__}: {exc}"
        pruned_at = storage.get_trial(trial._trial_id).user_attrs.get(PRUNED_AT)
        if search.stopping.is_set() and pruned_at is None:
            return  # stopped by the user: left RUNNING, resumed by the next tuner
    else:
        code, line = 0, ""  # pruned before its tuner died: its checkpoint is kept, nothing to train
    if code != 0:
        _failed(search, study, storage, trial, code, line, log)
        return
    summary = read_summary(run_dir)
    if pruned_at is not None and summary.get("preempted") is not False:
        study.tell(trial, state=TrialState.PRUNED)
        print(f"crosstrain tune: trial {trial.number} pruned at step {pruned_at}", file=log, flush=True)
        return
    # a trial asked to stop at a vote that came only after its last step has finished: COMPLETE, with its value
    value = metric_value(run_dir, search.settings.metric, summary)
    if value is None:
        study.tell(trial, state=TrialState.FAIL)
        print(f"crosstrain tune: trial {trial.number} reported no finite {search.settings.metric}", file=log,
              flush=True)
        return
    study.tell(trial, value)
    print(f"crosstrain tune: trial {trial.number} {search.settings.metric} {value:.4f}", file=log, flush=True)


def _failed(search: Search, study: Any, storage: Any, trial: Any, code: int | None, line: str, log: Any) -> None:
    """Record a trial that exited non-zero: FAIL, and when its machine was the cause (and ``retries`` > 0) queued
    again with its parameters; past ``retries`` such failures of one point in this run the search stops."""
    from optuna.trial import TrialState

    from crosstrain.checkpoint.space import free_bytes
    from crosstrain.errors import CrosstrainError
    from crosstrain.plugins.tune.retry import CAUSE, RETRY_OF, enqueue_retry, environment_cause
    from crosstrain.plugins.tune.study import study_lock

    free = free_bytes(trial.user_attrs["run_dir"])
    cause = environment_cause(code, line, free) if search.settings.retries else None
    exit_text = "could not start" if code is None else f"exit {code}"
    print(f"crosstrain tune: trial {trial.number} failed ({exit_text}): {line or '(no output)'}", file=log,
          flush=True)
    if cause is None:
        study.tell(trial, state=TrialState.FAIL)
        return
    first = trial.user_attrs.get(RETRY_OF, trial.number)
    search.attempts[first] = search.attempts.get(first, 0) + 1
    with study_lock(search.out, search.study_name, storage):  # told and queued before a worker counts them
        trial.set_user_attr(CAUSE, cause)
        frozen = study.tell(trial, state=TrialState.FAIL)
        enqueue_retry(study, frozen)
    if search.attempts[first] > search.settings.retries:  # the workers start nothing more
        search.errors.append(CrosstrainError(
            f"trial {first}'s parameters failed {search.attempts[first]} times from the machine "
            f"({cause}{': ' + line if line else ''}); "
            "they stay queued: fix the cause and run the same command (tune.retries sets the retries per run)"))
        return
    print(f"crosstrain tune: {cause}: trial {trial.number}'s parameters queued again (try "
          f"{search.attempts[first] + 1} of {search.settings.retries + 1})", file=log, flush=True)


def result(study: Any, storage_url: str) -> dict[str, Any]:
    """The JSON line: the study, its storage, the best trial and how many trials ended each way (``failed``: not
    counting the trials that failed because of their machine, ``retried``, whose parameters were run again)."""
    from optuna.trial import TrialState

    from crosstrain.plugins.tune.retry import CAUSE
    from crosstrain.plugins.tune.storage import shown_url

    trials = study.get_trials(deepcopy=False)
    retried = sum(CAUSE in t.user_attrs for t in trials)
    count = {s: sum(t.state == s for t in trials) for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
    best = None
    if count[TrialState.COMPLETE]:
        best = study.best_trial
    return {
        "study": study.study_name,
        "storage": shown_url(storage_url),  # a password in the URL is not printed
        "best_value": best.value if best else None,
        "best_params": best.params if best else None,
        "best_run_dir": best.user_attrs.get("run_dir") if best else None,
        "complete": count[TrialState.COMPLETE],
        "pruned": count[TrialState.PRUNED],
        "failed": count[TrialState.FAIL] - retried,
        "retried": retried,
    }
