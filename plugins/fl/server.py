"""``crosstrain fl server``: the round loop, global-model updates, checkpoints, metrics and summary.json."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from crosstrain.checkpoint.atomic import atomic_write
from crosstrain.config import Config
from crosstrain.engine.metrics import JsonlSink, MetricsHub
from crosstrain.errors import ConfigError, CrosstrainError
from crosstrain.plugins.fl.config import FLSection
from crosstrain.plugins.fl.coordinator import Coordinator
from crosstrain.plugins.fl.globalstate import Layout, load_latest, save_round
from crosstrain.plugins.fl.rounds import run_round


class FLError(CrosstrainError):
    """The federation cannot go on (too few clients joined); the last completed round stays checkpointed."""

    exit_code = 1


def fl_section(config: Config) -> FLSection:
    section = config.section("fl")
    assert isinstance(section, FLSection)
    return section


def check_modes(fl: FLSection) -> None:
    """Secure aggregation and DP need the protocol engineer's modules: a clear error when they are absent."""
    needed = (["crosstrain.plugins.fl.secagg"] if fl.secure else []) + (["crosstrain.plugins.fl.dp"]
                                                                         if fl.dp_clip > 0 else [])
    import importlib

    for name in needed:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"fl.secure / fl.dp_* need {name}, which does not import ({exc}); set fl.secure=false "
                              "and fl.dp_clip=0") from None


def epsilon(fl: FLSection, rounds: int) -> float | None:
    """(epsilon, fl.dp_delta)-DP of ``rounds`` noisy rounds (RDP accountant in :mod:`.dp`), None without noise."""
    if fl.dp_noise <= 0 or rounds == 0:
        return None
    from crosstrain.plugins.fl.dp import epsilon as rdp_epsilon

    return float(rdp_epsilon(fl.dp_noise, rounds, fl.dp_delta))


class FLServer:
    """Holds the global model and runs ``fl.rounds`` rounds through ``coordinator``, resuming from ``run_dir``."""

    def __init__(self, config: Config, run_dir: Path, coordinator: Coordinator) -> None:
        import torch

        from crosstrain.recipes.lm import build_model

        self.config, self.fl, self.run_dir, self.coordinator = config, fl_section(config), run_dir, coordinator
        check_modes(self.fl)
        torch.manual_seed(config.train.seed)  # the same initial weights as `crosstrain train` builds
        model = build_model(config)
        self.layout = Layout(model)
        self.global_vec = self.layout.flatten(model)
        self.completed = 0
        self.dropped: set[int] = set()
        self.clients_seen: set[int] = set()
        self.history: list[dict[str, Any]] = []
        resumed = load_latest(run_dir / "global", self.layout)
        if resumed is not None:
            self.global_vec, record = resumed
            self.completed = int(record["rounds_completed"])
            self.dropped = set(record.get("dropped_clients", []))
            self.clients_seen = set(record.get("clients_seen", []))
            self.history = list(record.get("history", []))
        self.resumed_from = self.completed
        self.rng = np.random.default_rng([config.train.seed, self.completed])

    def run(self) -> dict[str, Any]:
        fl = self.fl
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # one record per round (step = round); a resumed server drops the records of rounds it will run again
        self.metrics = MetricsHub([JsonlSink(self.run_dir / "metrics.jsonl", resume_step=self.completed)])
        started = time.perf_counter()
        try:
            for round_id in range(self.completed, fl.rounds):
                self._round(round_id)
        finally:
            self.coordinator.finish()
            self.metrics.close()
        summary = self.summary(time.perf_counter() - started)
        atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=1).encode())
        return summary

    def _round(self, round_id: int) -> None:
        fl = self.fl
        joined = self.coordinator.wait_for_clients(fl.clients, fl.join_timeout_s)
        if len(joined) < fl.min_clients:  # stop without using up a round: a rerun resumes here
            raise FLError(f"round {round_id + 1}: {len(joined)} clients joined within fl.join_timeout_s="
                          f"{fl.join_timeout_s:g}, fl.min_clients={fl.min_clients}; start more clients or raise "
                          "fl.join_timeout_s")
        t0 = time.perf_counter()
        outcome = run_round(self.coordinator, fl, round_id, self.global_vec, joined[:fl.clients], self.rng)
        if outcome.mean is not None:
            candidate = (self.global_vec + fl.server_lr * outcome.mean).astype(np.float32)
            if np.isfinite(candidate).all():
                self.global_vec = candidate
            else:  # e.g. finite float32 updates whose sum overflows: never save a model that cannot be used
                outcome.error, outcome.mean = "the updated global model would have non-finite values", None
        self.clients_seen |= set(outcome.survivors) | set(outcome.dropped)
        self.dropped |= set(outcome.dropped)
        stats = {k: v for k, v in outcome.stats.items() if isinstance(v, (int, float, str))}
        record = {**stats, "round": round_id + 1, "clients": len(outcome.survivors) + len(outcome.dropped),
                  "survivors": outcome.survivors, "dropped": outcome.dropped, "loss": _finite(outcome.loss),
                  "secure": fl.secure, "round_s": time.perf_counter() - t0,
                  "update_norm": None if outcome.mean is None else float(np.linalg.norm(outcome.mean)),
                  "aborted": outcome.error or None, "epsilon": epsilon(fl, round_id + 1),
                  "refused": {str(c): why for c, why in sorted(outcome.refused.items())}}
        self.history.append(record)
        self.metrics.write(round_id + 1, record)
        print(f"fl round {round_id + 1}/{fl.rounds}: " + (f"loss {outcome.loss:.4f}, {len(outcome.survivors)} "
              f"clients, dropped {outcome.dropped}" if outcome.mean is not None else f"failed: {outcome.error}")
              + (f" (refused: {outcome.refused})" if outcome.refused else ""),
              flush=True)
        self.completed = round_id + 1
        save_round(self.run_dir / "global", self.layout, self.global_vec, self.completed,
                   {"dropped_clients": sorted(self.dropped), "clients_seen": sorted(self.clients_seen),
                    "history": self.history}, fl.keep_last)

    def summary(self, wall_s: float) -> dict[str, Any]:
        done = [h for h in self.history if h["aborted"] is None]
        return {"rounds": self.completed, "resumed_from_round": self.resumed_from, "clients": len(self.clients_seen),
                "secure": self.fl.secure, "final_loss": done[-1]["loss"] if done else None,
                "initial_loss": done[0]["loss"] if done else None,
                "dropped_clients": sorted(self.dropped),
                "refused_updates": sum(len(h.get("refused", {})) for h in self.history),
                "failed_rounds": [h["round"] for h in self.history if h["aborted"] is not None],
                "epsilon": epsilon(self.fl, self.completed), "delta": self.fl.dp_delta if self.fl.dp_noise else None,
                "global_model": str(self.run_dir / "global"), "params": self.layout.dim, "wall_s": wall_s,
                "rejected_messages": self.coordinator.rejected}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
