"""One federated round on the server, over any transport (:class:`.coordinator.Coordinator`).

Stage ``train`` sends every selected client the global weights (float32) and the round's settings. Plain mode:
each client answers with its update (local - global weights, float32) and the server forms the weighted
FedAvg mean (McMahan et al. 2017). Secure mode: each client answers with its weight and loss only, then the
SecAgg+ stages of :mod:`crosstrain.plugins.fl.secagg` (Bell et al. 2020) run and the server learns only the
weighted mean of the survivors' updates. A client that misses a stage's deadline is a dropout.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from crosstrain.plugins.fl.config import FLSection
from crosstrain.plugins.fl.coordinator import Coordinator, Refused
from crosstrain.plugins.fl.framing import TransportError
from crosstrain.plugins.fl.robust import aggregate, norm_outliers, secure_problem, update_problem

TRAIN = "train"


@dataclass
class RoundOutcome:
    """What one round produced; ``mean`` is None when it failed (too few survivors, or SecAgg+ aborted)."""

    round: int
    mean: np.ndarray | None
    survivors: list[int]
    dropped: list[int]
    loss: float
    total_weight: float
    stats: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    refused: dict[int, str] = field(default_factory=dict)  # clients whose update the server refused, and why


def _number(header: dict[str, Any], key: str, positive: bool = False) -> float:
    value = header.get(key)
    if not isinstance(value, (int, float)) or not math.isfinite(value) or (positive and value <= 0):
        raise TransportError(f"reply header {key}={value!r} must be a finite {'positive ' if positive else ''}number")
    return float(value)


def _train_validator(dim: int, fl: FLSection, refused: dict[int, str]) -> Any:
    """Checks a ``train`` reply: its form (a TransportError, as for a tampered frame), then its content
    (:func:`.robust.update_problem`: a :class:`.coordinator.Refused`, recorded in ``refused``)."""
    def validate(client: int, header: dict[str, Any], payload: bytes) -> None:
        _number(header, "weight", positive=True)
        _number(header, "loss")
        want = 0 if fl.secure else 4 * dim
        if len(payload) != want:
            raise TransportError(f"client {client}: update of {len(payload)} bytes, expected {want} "
                                 f"({'none in secure mode' if fl.secure else f'{dim} float32'})")
        problem = update_problem(fl, header, None if fl.secure else np.frombuffer(payload, dtype=np.float32))
        if problem is not None:
            refused[client] = problem
            raise Refused(f"client {client}: {problem}; the update is refused")
    return validate


def _norm(header: dict[str, Any], payload: bytes, secure: bool) -> float:
    """A validated reply's update norm: the one the client reports (secure mode), else the update's own."""
    if secure:
        return float(header["norm"])
    return float(np.linalg.norm(np.frombuffer(payload, dtype=np.float32).astype(np.float64)))


def _weighted_loss(replies: dict[int, tuple[dict[str, Any], bytes]], ids: list[int]) -> float:
    weights = [float(replies[c][0]["weight"]) for c in ids]
    losses = [float(replies[c][0]["loss"]) for c in ids]
    return float(np.average(losses, weights=weights)) if ids else float("nan")


def run_round(coordinator: Coordinator, fl: FLSection, round_id: int, global_vec: np.ndarray,
              participants: list[int], rng: np.random.Generator) -> RoundOutcome:
    """Run round ``round_id`` with ``participants``; DP noise (``fl.dp_*``) is added here in central mode."""
    dim = int(global_vec.shape[0])
    meta = {"secure": fl.secure, "local_steps": fl.local_steps, "dim": dim, "fedprox_mu": fl.fedprox_mu,
            "dp_clip": fl.dp_clip, "dp_noise": fl.dp_noise if fl.dp_mode == "distributed" else 0.0,
            "selected": len(participants), "clip_norm": fl.clip_norm}
    started = time.perf_counter()
    refused: dict[int, str] = {}
    coordinator.open_stage(round_id, TRAIN, {c: global_vec.astype(np.float32).tobytes() for c in participants},
                           meta, _train_validator(dim, fl, refused))
    replies = coordinator.wait(fl.stage_timeout_s)
    outliers = norm_outliers({c: _norm(header, payload, fl.secure) for c, (header, payload) in replies.items()},
                             fl.max_norm_ratio)
    for client, why in outliers.items():  # refused like an update that fails the validator, only later
        refused[client] = why
        del replies[client]
    coordinator.count_refused(len(outliers))
    trained = sorted(replies)
    stats: dict[str, Any] = {"train_s": time.perf_counter() - started}
    if len(trained) < fl.min_clients:
        return RoundOutcome(round_id, None, trained, sorted(set(participants) - set(trained)), float("nan"), 0.0,
                            stats, f"{len(trained)} of {len(participants)} clients finished training, "
                            f"fl.min_clients={fl.min_clients}", refused)
    agg_start = time.perf_counter()
    if fl.secure:
        outcome = _secure(coordinator, fl, round_id, replies, trained, dim)
    else:
        weights = np.array([float(replies[c][0]["weight"]) for c in trained])
        updates = np.stack([np.frombuffer(replies[c][1], dtype=np.float32) for c in trained])
        mean, robust_stats = aggregate(fl, updates, weights)
        outcome = RoundOutcome(round_id, mean, trained, [], 0.0, float(weights.sum()),
                               {"clipped": 0, "overflowed": 0, **robust_stats})
    outcome.refused = refused
    outcome.dropped = sorted(set(participants) - set(outcome.survivors))
    outcome.loss = _weighted_loss(replies, outcome.survivors)
    outcome.stats.update(stats)
    outcome.stats["aggregate_s"] = time.perf_counter() - agg_start
    if outcome.mean is not None and fl.dp_noise > 0 and fl.dp_mode == "central":
        from crosstrain.plugins.fl.dp import add_gaussian_noise

        # std z * C on the sum of clipped unit-weight updates (the Gaussian mechanism), so z * C / n on the mean
        std = fl.dp_noise * fl.dp_clip / max(outcome.total_weight, 1.0)
        outcome.mean = add_gaussian_noise(outcome.mean, std, rng).astype(np.float32)
    return outcome


def _secure(coordinator: Coordinator, fl: FLSection, round_id: int,
            replies: dict[int, tuple[dict[str, Any], bytes]], trained: list[int], dim: int) -> RoundOutcome:
    from crosstrain.plugins.fl.secagg import STAGES, SecAggAbort, SecAggParams, ServerSession

    if len(trained) < 2:
        return RoundOutcome(round_id, None, [], [], float("nan"), 0.0, {},
                            f"secure aggregation needs 2 clients, {len(trained)} finished training")
    # SecAgg+ quantises each client's weighted update w x: plan for the largest w ||x|| (x after clip + noise)
    weights = {c: _number(replies[c][0], "weight", positive=True) for c in trained}
    norm = max(weights[c] * _number(replies[c][0], "norm") for c in trained)
    params, why = SecAggParams.plan(len(trained), fl.expected_dropout, max(norm, 1e-12), dim,
                                    max_weight=max(weights.values()))
    session = ServerSession(round_id, params, trained)
    meta = {"params": dataclasses.asdict(params)}
    stats: dict[str, Any] = {"plan": why, "neighbours": params.neighbours, "threshold": params.threshold,
                             "bits": params.bits, "clip": params.clip}

    def accept(stage: str) -> Any:
        return lambda client, header, payload: session.accept(stage, client, payload)

    try:
        for stage in STAGES:
            started = time.perf_counter()
            coordinator.open_stage(round_id, stage, session.requests(stage), meta, accept(stage))
            coordinator.wait(fl.stage_timeout_s)
            session.close_stage(stage)
            stats[f"{stage}_s"] = time.perf_counter() - started
        result = session.result()
    except SecAggAbort as exc:
        return RoundOutcome(round_id, None, [], [], float("nan"), 0.0, stats, f"secure aggregation aborted: {exc}")
    stats.update(result.stats)
    survivors = sorted(result.survivors)
    problem = secure_problem(np.asarray(result.mean), [_number(replies[c][0], "norm") for c in survivors],
                             [weights[c] for c in survivors], result.stats, 2 * params.clip / params.levels,
                             float(result.total_weight))
    if problem is not None:  # one of the survivors lied: the round must not touch the global model
        return RoundOutcome(round_id, None, survivors, sorted(result.dropped), 0.0, 0.0, stats,
                            f"secure aggregate refused: {problem}")
    return RoundOutcome(round_id, np.asarray(result.mean, dtype=np.float32), sorted(result.survivors),
                        sorted(result.dropped), 0.0, float(result.total_weight), stats)
