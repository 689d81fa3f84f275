"""The observability plugin's hooks: ``crosstrain report``, the Prometheus and MLflow sinks and report panels of
known plugin metrics (MoE expert load, RLHF rewards and KL)."""

from __future__ import annotations

import argparse
from typing import Any

import crosstrain

_profiler: Any = None


@crosstrain.hookimpl
def crosstrain_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from crosstrain.plugins.observability.cli import add_commands

    add_commands(subparsers)


@crosstrain.hookimpl
def crosstrain_on_step_end(context: Any, step: int, metrics: dict[str, float]) -> None:
    global _profiler
    spec = context.config.observability.profile_steps
    if not spec:
        return
    from crosstrain.plugins.observability.profiler import StepProfiler, parse_steps

    if _profiler is None or (_profiler.first, _profiler.last) != parse_steps(spec):
        _profiler = StepProfiler(*parse_steps(spec))
    _profiler.step_end(context, step, metrics)


@crosstrain.hookimpl
def crosstrain_metrics_sinks(config: Any) -> list[Any]:
    obs = config.observability
    sinks: list[Any] = []
    if obs.prometheus_port:
        from crosstrain.plugins.observability.prometheus import PrometheusSink

        sinks.append(PrometheusSink(obs.prometheus_port, obs.prometheus_host))
    if obs.mlflow:
        from crosstrain.plugins.observability.mlflow_sink import MlflowSink

        sinks.append(MlflowSink(config))
    return sinks


@crosstrain.hookimpl
def crosstrain_report_panels() -> list[Any]:
    from crosstrain.plugins.observability.panels import Panel

    return [Panel("moe_max_load", "MoE expert load (max share per layer)", ("moe/*/max_load",), "max load"),
            Panel("rlhf_rewards", "RLHF rewards", ("rewards/*",), "reward"),
            Panel("rlhf_kl", "RLHF KL to the reference", ("kl", "objective/kl", "*/kl"), "KL")]
