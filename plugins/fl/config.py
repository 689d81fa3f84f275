"""``[fl]``: federated training options (docs/fl.md); read by ``crosstrain fl server|client|simulate``."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def trimmed_count(n: int, fraction: float) -> int:
    """Updates a trimmed mean drops at each end of a coordinate: ``floor(fraction * n)`` (Yin et al. 2018)."""
    return math.floor(fraction * n + 1e-9)  # 1e-9: 0.25 * 4 is 1 even where the product rounds below it


class FLSection(BaseModel):
    """One config file serves the server and every client; each reads the keys it needs."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    rounds: int = Field(default=4, ge=1, description="federated rounds")
    clients: int = Field(default=4, ge=1, description="clients taking part; the data is split into this many shards")
    min_clients: int = Field(default=1, ge=1, description="a round needs at least this many surviving clients")
    local_steps: int = Field(default=15, ge=1, description="optimizer steps each client takes per round")
    secure: bool = Field(default=True, description="SecAgg+ secure aggregation: the server learns only the weighted "
                         "mean (false: plain FedAvg, the server sees each update)")
    expected_dropout: float = Field(default=0.1, ge=0, lt=0.5, description="dropout rate the SecAgg+ planner plans "
                                    "for (below 0.5: the threshold is a majority of each neighbourhood)")
    fedprox_mu: float = Field(default=0.0, ge=0, description="FedProx proximal term mu * ||w - w_global||^2 / 2")
    server_lr: float = Field(default=1.0, gt=0, description="global += server_lr * weighted mean of the updates")
    address: str = Field(default="127.0.0.1:0", pattern=r"^[^:\s]+:[0-9]{1,5}$",
                         description="HOST:PORT the server listens on (port 0 = any free port, written to "
                         "<run dir>/address)")
    certs: str = Field(default="", description="folder from `crosstrain fl certs` (ca.crt, server.*, client-N.*)")
    join_timeout_s: float = Field(default=120.0, gt=0, description="how long a round waits for clients to join")
    stage_timeout_s: float = Field(default=120.0, gt=0, description="a client that has not replied when a stage "
                                   "closes is a dropout")
    keep_last: int = Field(default=3, ge=1, description="global-model checkpoints kept (one per round)")
    dp_clip: float = Field(default=0.0, ge=0, description="clip each client's update to this L2 norm (0 = off)")
    dp_noise: float = Field(default=0.0, ge=0, description="Gaussian noise multiplier z (std z * dp_clip on the sum)")
    dp_mode: Literal["central", "distributed"] = Field(default="central", description='"central": the server adds '
                                                       'the noise to the sum; "distributed": each client adds its '
                                                       "share before masking")
    dp_delta: float = Field(default=1e-5, gt=0, lt=1, description="delta of the reported (epsilon, delta)")
    clip_norm: float = Field(default=0.0, ge=0, description="norm bound: each client clips its update to this L2 "
                             "norm before sending or masking it; the server refuses a larger one (0 = off)")
    max_norm_ratio: float = Field(default=10.0, ge=0, description="refuse an update whose L2 norm is above this "
                                  "many times the median of the round's update norms (3 or more updates; 0 = off)")
    aggregation: Literal["mean", "median", "trimmed_mean"] = Field(
        default="mean", description='plain mode: "mean" (weighted FedAvg), or the coordinate-wise "median" or '
        '"trimmed_mean" of the updates (Yin et al. 2018), which a few outlying clients cannot drag away')
    trim_fraction: float = Field(default=0.1, ge=0, lt=0.5, description="trimmed_mean: the fraction of the "
                                 "updates dropped at each end of every coordinate")

    @field_validator("address")
    @classmethod
    def _port_in_range(cls, value: str) -> str:
        port = int(value.rsplit(":", 1)[1])
        if port > 65535:
            raise ValueError(f"fl.address={value!r}: port {port} is beyond 65535; pick a port in 1..65535 (0: any "
                             "free port, server only)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> FLSection:
        if self.min_clients > self.clients:
            raise ValueError(f"fl.min_clients={self.min_clients} exceeds fl.clients={self.clients}; lower it")
        if self.secure and self.clients < 2:
            raise ValueError("fl.secure=true needs fl.clients >= 2 (a sum of one update reveals it); set "
                             "fl.secure=false or add clients")
        if self.dp_noise > 0 and self.dp_clip == 0:
            raise ValueError("fl.dp_noise > 0 needs fl.dp_clip > 0 (the noise is scaled to the clipping norm)")
        self._robust_consistent()
        return self

    def _robust_consistent(self) -> None:
        if self.aggregation != "mean" and self.secure:
            raise ValueError(f"fl.aggregation={self.aggregation!r} needs each update, which SecAgg+ hides; set "
                             "fl.secure=false or fl.aggregation='mean'")
        if self.aggregation != "mean" and self.dp_noise > 0:
            raise ValueError(f"fl.aggregation={self.aggregation!r}: the DP noise is calibrated for the mean; set "
                             "fl.aggregation='mean' or fl.dp_noise=0")
        if self.aggregation == "trimmed_mean" and trimmed_count(self.clients, self.trim_fraction) < 1:
            raise ValueError(f"fl.trim_fraction={self.trim_fraction:g} trims none of fl.clients={self.clients} "
                             f"updates per coordinate; raise it to at least {math.ceil(1e3 / self.clients) / 1e3:g} "
                             "or use 'median'")
        if self.clip_norm > 0 and self.dp_noise > 0 and self.dp_mode == "distributed":
            raise ValueError("fl.clip_norm with fl.dp_mode='distributed': each client's noise lifts its update "
                             "above the bound the server checks; bound it with fl.dp_clip or use dp_mode='central'")

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.address.rsplit(":", 1)
        return host, int(port)
