"""What a report plots: :class:`Panel`, the built-in panels and the ``crosstrain_report_panels`` hook.

A plugin adds panels for the metrics it reports by implementing the hook (see docs/observability.md)::

    from crosstrain import hookimpl
    from crosstrain.plugins.observability.panels import Panel

    @hookimpl
    def crosstrain_report_panels():
        return [Panel("rewards", "RLHF rewards", keys=("rewards/*",))]

A panel with ``keys`` draws one line per matching ``metrics.jsonl`` key (``fnmatch`` patterns) and per run;
a plugin panel with no matching data is left out of the page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from crosstrain.hookspecs import hookspec


@dataclass(frozen=True)
class Panel:
    """One plot. ``id``: the PNG's name and the page's ``panel-<id>`` element; ``kind``: how it is drawn
    (``line``: ``keys`` of metrics.jsonl against the step; the others are the built-in views)."""

    id: str
    title: str
    keys: tuple[str, ...] = ()
    ylabel: str = ""
    kind: Literal["line", "breakdown", "ranks", "checkpoints"] = "line"
    log_y: bool = False
    builtin: bool = False  # built-in panels are always on the page ("no data" when empty)


#: the step-time parts stacked in the breakdown, bottom to top (checkpoint: from the checkpoint events).
BREAKDOWN = (("time_data_s", "data"), ("time_forward_s", "forward"), ("time_backward_s", "backward"),
             ("time_comm_s", "communication wait"), ("time_optimizer_s", "optimizer"), ("checkpoint", "checkpoint"))

BUILTIN = (
    Panel("loss", "Loss (train and eval)", ("loss", "eval/loss"), "loss", builtin=True),
    Panel("lr", "Learning rate", ("lr",), "lr", builtin=True),
    Panel("grad_norm", "Gradient norm", ("grad_norm",), "norm", log_y=True, builtin=True),
    Panel("tokens_per_s", "Throughput", ("tokens_per_s",), "tokens/s", builtin=True),
    Panel("mfu", "Model FLOPs utilisation", ("mfu",), "MFU", builtin=True),
    Panel("memory", "Peak memory", ("peak_memory_bytes",), "bytes", builtin=True),
    Panel("step_breakdown", "Step time breakdown", ylabel="seconds", kind="breakdown", builtin=True),
    Panel("rank_step_time", "Per-rank step time and memory", ylabel="seconds", kind="ranks", builtin=True),
    Panel("checkpoint_save", "Checkpoint save durations", ylabel="seconds", kind="checkpoints", builtin=True),
)

#: events drawn as vertical markers on every step panel: name -> (colour, line style)
MARKERS = {"resume": ("tab:green", "--"), "rollback": ("tab:red", "-."), "preemption": ("tab:purple", ":"),
           "straggler": ("tab:orange", ":"), "hang": ("black", "--")}


@hookspec
def crosstrain_report_panels() -> list[Panel]:
    """Return :class:`Panel` objects for ``crosstrain report`` to draw (e.g. MoE expert load, RLHF rewards)."""
    return []


def report_panels() -> list[Panel]:
    """The built-in panels, then every plugin's in plugin order (a raising plugin is reported and left out)."""
    from crosstrain import pluginmanager

    extra = [p for _, panels in pluginmanager.call_each("crosstrain_report_panels") for p in panels or []]
    seen = {p.id for p in BUILTIN}
    return [*BUILTIN, *[p for p in extra if p.id not in seen and not seen.add(p.id)]]  # type: ignore[func-returns-value]
