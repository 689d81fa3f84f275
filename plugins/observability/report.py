"""``crosstrain report``: one self-contained HTML page (PNGs inlined) plus a PNG per panel, from run dirs.

Several run dirs overlay in every panel (one colour per run); the step-time breakdown gets one stacked plot per
run. A run still going is read as far as it got (the page says so). Needs matplotlib (the ``observability`` extra).
"""

from __future__ import annotations

import base64
import fnmatch
import html
import io
import re
import time
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.atomic import atomic_write
from crosstrain.plugins.observability.panels import BREAKDOWN, MARKERS, Panel, report_panels
from crosstrain.plugins.observability.rundata import RunData, load_run, numeric


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        from crosstrain.errors import ConfigError

        raise ConfigError("crosstrain report needs matplotlib; install it with: pip install 'crosstrain[observability]'"
                          ) from None
    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def _markers(ax: Any, runs: list[RunData]) -> None:
    """Resumes, rollbacks, preemptions (and stragglers, hangs) as vertical lines, one legend entry each."""
    labelled: set[str] = set()
    for run in runs:
        for e in run.events:
            style = MARKERS.get(str(e.get("event")))
            if style is None or not isinstance(e.get("step"), int):
                continue
            name = str(e["event"])
            ax.axvline(e["step"], color=style[0], linestyle=style[1], linewidth=1, alpha=0.7,
                       label=name if name not in labelled else None)
            labelled.add(name)


def _keys(panel: Panel, run: RunData) -> list[str]:
    available = run.keys()
    return [k for pattern in panel.keys for k in available if fnmatch.fnmatchcase(k, pattern)]


def _draw(plt: Any, panel: Panel, runs: list[RunData]) -> tuple[Any, int]:
    """The panel's figure and how many points it plots."""
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    points = 0
    if panel.kind == "breakdown":
        fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 3.6), squeeze=False, sharey=True)
        for ax, run in zip(axes[0], runs, strict=True):
            steps = [int(r["step"]) for r in run.metrics if "step" in r]
            ckpt = {e["step"]: float(e.get("duration_s", 0.0)) for e in run.events if e.get("event") == "checkpoint"}
            layers, labels = [], []
            for key, label in BREAKDOWN:
                if key == "checkpoint":
                    values = [ckpt.get(s, 0.0) for s in steps]
                else:
                    values = [float(r.get(key, 0.0)) if isinstance(r.get(key), (int, float)) else 0.0
                              for r in run.metrics if "step" in r]
                if any(values):
                    layers.append(values)
                    labels.append(label)
            if steps and layers:
                ax.stackplot(steps, layers, labels=labels)
                points += len(steps) * len(layers)
            ax.set_title(run.name, fontsize=9)
            ax.set_xlabel("step")
            _markers(ax, [run])
            ax.legend(fontsize=7, loc="upper right")
        axes[0][0].set_ylabel(panel.ylabel)
        return fig, points
    if panel.kind == "ranks":
        fig, (ax, ax_mem) = plt.subplots(1, 2, figsize=(11, 3.6))
        for i, run in enumerate(runs):
            for rank, records in sorted(run.ranks.items()):
                label = f"{run.name} rank {rank}" if len(runs) > 1 else f"rank {rank}"
                style = ["-", "--", ":", "-."][rank % 4]
                for axis, key in ((ax, "step_time_s"), (ax_mem, "peak_memory_bytes")):
                    steps, values = numeric(records, key)
                    axis.plot(steps, values, style, color=colours[(i + rank) % len(colours)], label=label)
                    points += len(values)
        ax.set_ylabel("step time (s)")
        ax_mem.set_ylabel("peak memory (bytes)")
        for axis in (ax, ax_mem):
            axis.set_xlabel("step")
            _markers(axis, runs)
            axis.legend(fontsize=7)
        return fig, points
    fig, ax = plt.subplots(figsize=(7, 3.6))
    if panel.kind == "checkpoints":
        width = 0.8 / max(1, len(runs))
        for i, run in enumerate(runs):
            saves = [(e["step"], float(e["duration_s"])) for e in run.events
                     if e.get("event") == "checkpoint" and isinstance(e.get("duration_s"), (int, float))]
            if saves:
                ax.bar([s + i * width for s, _ in saves], [d for _, d in saves], width=width,
                       color=colours[i % len(colours)], label=run.name)
                points += len(saves)
    else:
        for i, run in enumerate(runs):
            for j, key in enumerate(_keys(panel, run)):
                steps, values = run.series(key)
                label = f"{run.name}: {key}" if len(runs) > 1 else key
                ax.plot(steps, values, ["-", "--", ":", "-."][j % 4], color=colours[i % len(colours)], label=label,
                        marker="o" if len(values) < 20 else None, markersize=3)
                points += len(values)
        if panel.log_y and points:
            ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    _markers(ax, runs)
    if points:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
    return fig, points


_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.2em .6em;font-size:.85em}
.panels{display:flex;flex-wrap:wrap;gap:1em}.panel{border:1px solid #ddd;padding:.5em}
.panel img{max-width:100%}.live{color:#b00}h2{font-size:1em;margin:.2em 0}"""

_SUMMARY_KEYS = ("steps", "world_size", "final_loss", "eval_loss", "tokens_per_s", "mfu", "peak_memory_bytes",
                 "median_step_time_s", "wall_s", "params_sha256")


def _summary_table(runs: list[RunData]) -> str:
    head = "".join(f"<th>{html.escape(r.name)}</th>" for r in runs)
    rows = [f"<tr><th>run dir</th>{''.join(f'<td>{html.escape(str(r.path))}</td>' for r in runs)}</tr>",
            "<tr><th>state</th>" + "".join(
                f"<td class='live'>running (no summary.json yet; step {r.metrics[-1]['step'] if r.metrics else 0})</td>"
                if r.live else "<td>finished</td>" for r in runs) + "</tr>"]
    for key in _SUMMARY_KEYS:
        cells = []
        for r in runs:
            v = (r.summary or {}).get(key, "")
            cells.append(f"<td>{html.escape(f'{v:.4g}' if isinstance(v, float) else str(v))}</td>")
        rows.append(f"<tr><th>{key}</th>{''.join(cells)}</tr>")
    return f"<table id='summary'><tr><th></th>{head}</tr>{''.join(rows)}</table>"


def _events_table(runs: list[RunData]) -> str:
    rows = []
    for r in runs:
        for e in r.events:
            detail = {k: v for k, v in e.items() if k not in ("step", "event", "time", "message")}
            rows.append(f"<tr><td>{html.escape(r.name)}</td><td>{e.get('step')}</td><td>{html.escape(str(e.get('event')))}"
                        f"</td><td>{html.escape(str(e.get('message') or detail))}</td></tr>")
    return ("<table id='events'><tr><th>run</th><th>step</th><th>event</th><th>detail</th></tr>"
            f"{''.join(rows)}</table>")


def metric_panels(names: list[str], runs: list[RunData]) -> list[Panel]:
    """One line panel per ``--metric NAME`` (an ``fnmatch`` pattern such as ``rewards/*`` draws every match);
    a name no run logged is a one-line error listing the metrics they did log."""
    logged = sorted({k for r in runs for k in r.keys() if r.series(k)[0]})
    panels = []
    for name in names:
        if not any(fnmatch.fnmatchcase(k, name) for k in logged):
            from crosstrain.errors import ConfigError

            raise ConfigError(f"--metric {name!r} is not in the runs' metrics.jsonl; logged metrics: "
                              f"{', '.join(logged)}")
        panels.append(Panel("metric-" + re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_"), name, (name,), name))
    return panels


def write_report(run_dirs: list[str | Path], out_dir: str | Path, metrics: list[str] | None = None) -> Path:
    """Write ``report.html`` and ``<panel id>.png`` for every panel into ``out_dir`` (the built-in and plugin
    panels, then one per name in ``metrics``: see :func:`metric_panels`); returns the HTML path."""
    runs = [load_run(d) for d in run_dirs]
    empty = [r for r in runs if not r.metrics]
    if empty:  # nothing to plot (matplotlib would only warn about empty axes)
        from crosstrain.errors import ConfigError

        raise ConfigError(f"{str(empty[0].path)!r} has no step records in metrics.jsonl yet; run the report once "
                          "the run has logged a step (or leave that run dir out)")
    asked = metric_panels(list(metrics or []), runs)  # a wrong name fails before matplotlib loads or a file is written
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    for panel in [*report_panels(), *asked]:
        if not panel.builtin and not any(_keys(panel, r) for r in runs):
            continue  # a plugin's panel for metrics these runs do not have
        fig, points = _draw(plt, panel, runs)
        fig.suptitle(panel.title, fontsize=10)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        png = buf.getvalue()
        atomic_write(out / f"{panel.id}.png", png)
        uri = "data:image/png;base64," + base64.b64encode(png).decode()
        sections.append(f"<section class='panel' id='panel-{panel.id}' data-points='{points}'>"
                        f"<h2>{html.escape(panel.title)}</h2><img alt='{html.escape(panel.title)}' src='{uri}'>"
                        "</section>")
    title = "crosstrain report: " + ", ".join(r.name for r in runs)
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>written {time.strftime('%Y-%m-%d %H:%M:%S')}</p>{_summary_table(runs)}"
            f"<div class='panels'>{''.join(sections)}</div><h2>Events</h2>{_events_table(runs)}</body></html>\n")
    path = out / "report.html"
    atomic_write(path, page)  # a browser reloading the page of a live run never sees half of it
    return path
