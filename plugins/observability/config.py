"""The observability plugin's config section, ``[observability]`` (registered by its ``crosstrain_config_sections``).

The engine's per-rank metrics and straggler report (:mod:`crosstrain.engine.ranks`) and hang dumps
(:mod:`crosstrain.engine.watchdog`) read it from ``config.plugins``; without the plugin they are off.
"""

from __future__ import annotations

import importlib.util
import ipaddress

from pydantic import Field, ValidationInfo, field_validator

from crosstrain.config.schema import Section


class ObservabilityConfig(Section):
    """``[observability]``: per-rank metrics, stragglers, hang dumps, the profiler, Prometheus and MLflow
    (docs/observability.md)."""

    per_rank: bool = Field(default=True, description="every rank appends its step times and memory to "
                           "ranks/metrics.rank<N>.jsonl (no collective); rank 0 reports stragglers")
    straggler_fraction: float = Field(default=0.5, gt=0, description="a rank busier than the median by this "
                                      "fraction ...")
    straggler_steps: int = Field(default=5, ge=1, description="... for this many steps in a row is a straggler")
    straggler_min_s: float = Field(default=0.01, ge=0, description="... and by at least this many seconds")
    hang_dump_s: float = Field(default=0.0, ge=0, description="write every rank's Python stacks to hangs/ when no "
                               "step completes for this many seconds (0 = off; < fault.collective_timeout_s)")
    profile_steps: str = Field(default="", pattern=r"^([1-9][0-9]*:[1-9][0-9]*)?$", description="A:B (2 <= A <= B): "
                               "a torch.profiler trace of steps A..B on every rank in profile/ (--profile-steps)")

    @field_validator("profile_steps")
    @classmethod
    def _steps_in_order(cls, value: str, info: ValidationInfo) -> str:
        if value and not 2 <= int(value.split(":")[0]) <= int(value.split(":")[1]):
            raise ValueError(f"{value!r}: need A:B with 2 <= A <= B (the profiler starts when step A-1 ends)")
        core = (info.context or {}).get("config")  # the validated core sections, when loaded by load_config
        steps = core.train.steps if core is not None else None
        if value and steps is not None and int(value.split(":")[1]) > steps:
            raise ValueError(f"{value} ends after the last step (train.steps={steps}), so nothing would be "
                             f"profiled; pick A:B with B <= {steps}")
        return value
    prometheus_port: int = Field(default=0, ge=0, le=65535, description="serve metrics for Prometheus on this "
                                 "port from rank 0 (0 = off; needs the observability extra)")
    prometheus_host: str = Field(default="127.0.0.1", description='address to serve on ("0.0.0.0": every interface)')

    @field_validator("prometheus_host")
    @classmethod
    def _host_is_an_address(cls, value: str) -> str:
        # dotted digits are meant as an IPv4 address: 999.1.1.1 is a typo, not a host name to look up
        if not value or (value.replace(".", "").isdigit() and not _is_ip(value)):
            raise ValueError(f"{value!r} is not an IP address or host name (e.g. 127.0.0.1 or 0.0.0.0)")
        return value
    mlflow: bool = Field(default=False, description="log params, metrics, events and the summary to MLflow from "
                         "rank 0 (needs the mlflow extra)")
    mlflow_tracking_uri: str = Field(default="", description='MLflow tracking store ("" = the file store '
                                     "file:<run_dir>/mlruns)")
    mlflow_experiment: str = Field(default="crosstrain", min_length=1, description="MLflow experiment of the run")

    @field_validator("mlflow")
    @classmethod
    def _mlflow_installed(cls, value: bool) -> bool:
        # here, not in the sink: every rank and the launcher stop before a worker starts or the run dir exists
        if value and importlib.util.find_spec("mlflow") is None:
            raise ValueError('needs MLflow; install it with: pip install "crosstrain[mlflow]" (or set '
                             "observability.mlflow=false)")
        return value


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True
