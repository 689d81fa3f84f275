"""Population-based training (Jaderberg et al. 2017, "Population Based Training of Neural Networks"), through
crosstrain's own checkpoints.

``population`` members train in ``rounds`` of ``train.steps / rounds`` steps, each member a run dir. After every
round but the last, the members are ranked by the round's eval metric; each of the worst quarter (at least one)
copies a member of the best quarter (**exploit**: its next round resumes from that member's checkpoint via
``checkpoint.resume``, weights, optimizer and data position) and perturbs the copied hyperparameters
(**explore**: a numeric value multiplied or divided by ``perturb``, clipped to its range; a choice re-drawn).
The state after each round is ``<out>/<study>/pbt.json``, so the same command after a kill continues from the
last finished round (a member's unfinished round resumes from its own checkpoint). Finished members are added to
the Optuna study as trials, so ``crosstrain tune --report`` and optuna-dashboard show them.

Each round's run has ``train.steps`` = the round's last step and ``schedule.total_steps`` = the whole run's
(unless the base config sets it), so a decaying LR schedule decays once over all rounds, as one uninterrupted run's.
"""

from __future__ import annotations

import json
import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.atomic import atomic_write
from crosstrain.errors import ConfigError
from crosstrain.plugins.tune.config import SearchSettings
from crosstrain.plugins.tune.space import Param, distribution, sample, snap
from crosstrain.plugins.tune.trial import last_metric


def explore(params: dict[str, Any], space: list[Param], factor: float, rng: random.Random) -> dict[str, Any]:
    """PBT's *perturb*: each numeric value times ``factor`` or divided by it (even odds), clipped to its range;
    each choice re-drawn from its choices (Jaderberg et al. 2017, section 4)."""
    out = dict(params)
    for p in space:
        if p.choices:
            out[p.key] = rng.choice(p.choices)
        else:
            out[p.key] = snap(p, params[p.key] * (factor if rng.random() < 0.5 else 1 / factor))
    return out


def exploit(values: list[float], maximize: bool) -> list[tuple[int, int]]:
    """``(loser, winner)`` pairs: each of the worst quarter (at least one, never the whole population) copies a
    member of the best quarter, the best to the worst, the second best to the second worst, ..."""
    n = len(values)
    quarter = max(1, n // 4)
    order = sorted(range(n), key=lambda i: values[i], reverse=maximize)  # best first
    return [(order[n - 1 - k], order[k % quarter]) for k in range(min(quarter, n - 1))]


def run_pbt(settings: SearchSettings, params: list[Param], name: str, **common: Any) -> dict[str, Any]:
    """Train the population to the end (or on from ``pbt.json``); returns the JSON line's fields."""
    from crosstrain.plugins.tune.search import prepare

    if not settings.metric.startswith("eval_"):
        raise ConfigError(f"strategy = 'pbt' ranks members by an eval metric each round; metric = "
                          f"{settings.metric!r} is not one: use metric = 'eval_loss'")
    common["trials"] = settings.population  # the population is the number of trials
    search = prepare(settings, params, name, **{**common, "trials": settings.population})
    _open_study(search)  # another space or base config under this --study: refused before any round trains
    steps = search.base.train.steps
    rounds = settings.rounds
    if steps % rounds:
        raise ConfigError(f"train.steps={steps} must be divisible by [tune] rounds = {rounds}; change either")
    per_round = steps // rounds
    total = search.base.schedule.total_steps or steps
    root = search.out / search.study_name
    state_path = root / "pbt.json"
    rng = random.Random(settings.seed)
    if state_path.is_file():
        state = json.loads(state_path.read_text())
    else:
        members: list[dict[str, Any]] = []
        for i in range(settings.population):
            chosen = {p.key: sample(p, rng) for p in params}
            if i == 0 and search.enqueue is not None:
                chosen = dict(search.enqueue)  # the base config is member 0
            members.append({"params": chosen, "resume_from": None, "values": [], "exploited": []})
        state = {"round": 0, "rng": None, "members": members}
    if state.get("rng") is not None:
        rng.setstate(_tuple(state["rng"]))
    command = search.command
    metric_key = command.intermediate
    log = sys.stderr
    lock = threading.Lock()
    while state["round"] < rounds:
        r = state["round"]
        end = (r + 1) * per_round

        def train(i: int, r: int = r, end: int = end) -> float:
            member = state["members"][i]
            run_dir = root / f"member_{i:02d}"
            extra = [f"train.steps={end}", f"schedule.total_steps={total}"]
            if member["resume_from"]:
                extra.append(f"checkpoint.resume={member['resume_from']}")
            code = command.run(run_dir, member["params"], -1, tuple(extra))
            value = _value_at(run_dir, metric_key, end)
            shown = f"exit {code}" if code else ("no value" if value is None else f"{value:.4f}")
            with lock:
                print(f"crosstrain tune: pbt round {r} member {i} {member['params']} -> {shown}", file=log, flush=True)
            if code or value is None:
                raise ConfigError(f"pbt member {i} failed in round {r} (exit {code}); see {run_dir}/tune_trial.log")
            return value

        with ThreadPoolExecutor(max_workers=search.jobs) as pool:
            values = list(pool.map(train, range(settings.population)))
        for i, v in enumerate(values):
            state["members"][i]["values"].append(v)
            state["members"][i]["resume_from"] = None
        if r + 1 < rounds:
            for loser, winner in exploit(values, settings.direction == "maximize"):
                src = root / f"member_{winner:02d}" / "checkpoints" / f"step_{end}"
                state["members"][loser]["resume_from"] = str(src.resolve())
                state["members"][loser]["params"] = explore(state["members"][winner]["params"], params,
                                                            settings.perturb, rng)
                state["members"][loser]["exploited"].append({"round": r, "from": winner})
        state["round"] = r + 1
        state["rng"] = list(rng.getstate()[1]), rng.getstate()[0], rng.getstate()[2]
        _write(state_path, state)
    return _record(search, state, root)


def _value_at(run_dir: Path, key: str, step: int) -> float | None:
    """The member's ``key`` at ``step`` (its last eval of the round) from metrics.jsonl."""
    found = None
    try:
        with open(run_dir / "metrics.jsonl") as f:
            for line in f:
                row = json.loads(line)
                if row.get("step") == step and key in row:
                    found = row[key]
    except (OSError, ValueError):
        return None
    return found if found is not None else last_metric(run_dir, key)


def _tuple(saved: Any) -> tuple:
    internal, version, gauss = saved
    return version, tuple(internal), gauss


def _write(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(state, indent=1))


def _open_study(search: Any) -> Any:
    """The study of the members (created, or continued when its space and base config are this search's)."""
    import optuna

    from crosstrain.plugins.tune.study import load_study, open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not search.storage_given:
        search.out.mkdir(parents=True, exist_ok=True)  # the study database is in it
    cfg = search.base
    return load_study(search.study_name, open_storage(search.storage_url, search.storage_given), search.settings,
                      search.params, cfg.train.steps, cfg.eval.every or cfg.train.steps, search.record)


def _record(search: Any, state: dict[str, Any], root: Path) -> dict[str, Any]:
    """Add the members to the study as finished trials (once) and return the result line."""
    import optuna

    from crosstrain.plugins.tune.search import result
    from crosstrain.plugins.tune.study import study_lock

    study = _open_study(search)
    dists = {p.key: distribution(p) for p in search.params}
    with study_lock(search.out, search.study_name):
        recorded = {t.user_attrs.get("run_dir") for t in study.get_trials(deepcopy=False)}
        for i, member in enumerate(state["members"]):
            run_dir = str((root / f"member_{i:02d}").resolve())
            if run_dir in recorded:
                continue
            values = member["values"]
            study.add_trial(optuna.trial.create_trial(
                params=member["params"], distributions=dists, value=values[-1],
                intermediate_values={k: v for k, v in enumerate(values)},
                user_attrs={"run_dir": run_dir, "pbt_exploited": member["exploited"]}))
    return result(study, search.storage_url)
