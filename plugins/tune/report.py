"""``crosstrain tune --report DIR``: what a person looks at after a search. In ``DIR/report``: ``summary.md`` (best
trial, its params and run dir, parameter importances, every trial's state and value), ``history.png``,
``intermediate.png`` and ``importances.png`` (Optuna's matplotlib visualisations), ``summary.json``, and the best
run's own report (``best_run/``, the observability plugin's ``crosstrain report``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.atomic import atomic_path, atomic_write
from crosstrain.errors import ConfigError


def _study(folder: Path, storage: str | None, study: str | None) -> Any:
    import optuna

    from crosstrain.plugins.tune.study import default_storage, open_storage

    if storage is None and not (folder / "tune.db").is_file():
        raise ConfigError(f"{str(folder)!r} holds no tune.db; pass the --out folder of a crosstrain tune search, "
                          "or --storage URL")
    url = storage or default_storage(folder)
    backend = open_storage(url, given=storage is not None)
    names = [s.study_name for s in optuna.get_all_study_summaries(backend, include_best_trial=False)]
    if study is None:
        if len(names) != 1:
            raise ConfigError(f"{url} holds {len(names)} studies ({', '.join(names) or 'none'}); pass --study NAME")
        study = names[0]
    elif study not in names:
        raise ConfigError(f"no study {study!r} in {url}; known: {', '.join(names) or 'none'}")
    return optuna.load_study(study_name=study, storage=backend)


def importances(study: Any) -> dict[str, float]:
    """Optuna's default (fANOVA, Hutter et al. 2014) importance of each parameter over the complete trials; empty
    when fewer than two trials completed or nothing varied."""
    import optuna

    try:
        return {k: float(v) for k, v in optuna.importance.get_param_importances(study).items()}
    except (ValueError, RuntimeError):
        return {}


def write_report(folder: str, storage: str | None = None, study: str | None = None) -> Path:
    """Write the report; returns ``DIR/report/summary.md``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    import optuna.visualization.matplotlib as vis
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    root = Path(folder)
    loaded = _study(root, storage, study)
    out = root / "report"
    out.mkdir(parents=True, exist_ok=True)
    trials = loaded.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = loaded.best_trial if complete else None
    weights = importances(loaded) if len(complete) >= 2 else {}
    plots = {"history.png": vis.plot_optimization_history, "intermediate.png": vis.plot_intermediate_values}
    if weights:
        plots["importances.png"] = vis.plot_param_importances
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
        for name, plot in plots.items():
            figure: Any = plot(loaded).figure
            with atomic_path(out / name) as tmp:
                figure.savefig(tmp, dpi=100, bbox_inches="tight")
            plt.close(figure)
    summary = {
        "study": loaded.study_name,
        "best_value": best.value if best else None,
        "best_params": best.params if best else None,
        "best_run_dir": best.user_attrs.get("run_dir") if best else None,
        "importances": weights,
        "trials": [{"number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
                    "run_dir": t.user_attrs.get("run_dir")} for t in trials],
    }
    atomic_write(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    lines = [f"# Study {loaded.study_name}", ""]
    if best:
        lines += [f"Best trial {best.number}: value {best.value:.6g}, run dir `{summary['best_run_dir']}`", "",
                  *(f"- `{k}` = {v!r}" for k, v in best.params.items()), ""]
    if weights:
        lines += ["## Parameter importances (fANOVA)", "", *(f"- `{k}`: {v:.3f}" for k, v in weights.items()), ""]
    lines += ["## Trials", "", "| # | state | value | params |", "|---|---|---|---|"]
    lines += [f"| {t['number']} | {t['state']} | {t['value']} | {t['params']} |" for t in summary["trials"]]
    lines += ["", *(f"![{p}]({p})" for p in plots)]
    best_dir = summary["best_run_dir"]
    if best_dir and Path(best_dir).is_dir():
        try:
            from crosstrain.plugins.observability.report import write_report as run_report

            run_report([best_dir], out / "best_run")
            lines += ["", "The best run's own report: [best_run/report.html](best_run/report.html)"]
        except (ImportError, ConfigError):
            pass
    atomic_write(out / "summary.md", "\n".join(lines) + "\n")
    return out / "summary.md"
