"""The observability plugin's hooks: the ``[observability]`` section, ``crosstrain report``, the Prometheus and
MLflow sinks, the profiler, and the ``crosstrain_report_panels`` hook other plugins implement for their metrics."""

from __future__ import annotations

import argparse
from typing import Any

import crosstrain

_profiler: Any = None


@crosstrain.hookimpl
def crosstrain_add_hookspecs(pluginmanager: Any) -> None:
    from crosstrain.plugins.observability import panels

    pluginmanager.add_hookspecs(panels)


@crosstrain.hookimpl
def crosstrain_config_sections() -> dict[str, type]:
    from crosstrain.plugins.observability.config import ObservabilityConfig

    return {"observability": ObservabilityConfig}


@crosstrain.hookimpl
def crosstrain_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from crosstrain.plugins.observability.cli import add_commands

    add_commands(subparsers)


@crosstrain.hookimpl
def crosstrain_on_step_end(context: Any, step: int, metrics: dict[str, float]) -> None:
    global _profiler
    spec = context.config.section("observability").profile_steps
    if not spec:
        return
    from crosstrain.plugins.observability.profiler import StepProfiler, parse_steps

    if _profiler is None or (_profiler.first, _profiler.last) != parse_steps(spec):
        _profiler = StepProfiler(*parse_steps(spec))
    _profiler.step_end(context, step, metrics)


@crosstrain.hookimpl
def crosstrain_metrics_sinks(config: Any) -> list[Any]:
    obs = config.section("observability")
    sinks: list[Any] = []
    if obs.prometheus_port:
        from crosstrain.plugins.observability.prometheus import PrometheusSink

        sinks.append(PrometheusSink(obs.prometheus_port, obs.prometheus_host))
    if obs.mlflow:
        from crosstrain.plugins.observability.mlflow_sink import MlflowSink

        sinks.append(MlflowSink(config))
    return sinks

