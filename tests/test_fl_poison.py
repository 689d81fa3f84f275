"""FL against a malicious-but-authenticated client (plugins/fl/robust.py): three client processes over gRPC and
mutual TLS on 127.0.0.1, two honest (crosstrain.plugins.fl.synthetic) and one that sends NaN, a 1e6-norm update,
or a 1e6-norm update under a false norm (tests/fl_poison_client.py). Plain mode refuses and counts it, or
out-votes it (coordinate-wise median); secure mode refuses it at the train reply, or fails the round whose
aggregate its false norm cannot explain and keeps the previous global model. The saved model is finite always."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from crosstrain.config import load_config
from crosstrain.plugins.fl import certs
from crosstrain.plugins.fl.client import FLClient, Round
from crosstrain.plugins.fl.config import FLSection
from crosstrain.plugins.fl.coordinator import Coordinator
from crosstrain.plugins.fl.grpc_transport import serve
from crosstrain.plugins.fl.robust import aggregate, norm_outliers, secure_mean_bound, trimmed_mean, update_problem
from crosstrain.plugins.fl.server import FLServer
from crosstrain.plugins.fl.synthetic import update

POISONER = 2  # client 2 misbehaves; clients 0 and 1 are honest
HONEST = [0, 1]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return certs.generate(tmp_path_factory.mktemp("pki"), 3)


def federate(pki: Path, run_dir: Path, plan: str, overrides: list[str]):
    """A server in this process, three client processes; returns the server, its summary and rounds, and the
    global model after each round (read back from the saved safetensors, as a flat vector)."""
    config = load_config(None, ["fl.clients=3", "fl.stage_timeout_s=300", "fl.join_timeout_s=600",
                                f"fl.keep_last={len(plan.split(','))}", *overrides])
    coordinator = Coordinator()
    server = FLServer(config, run_dir, coordinator)
    initial = server.global_vec.copy()
    grpc_server, port = serve(coordinator, certs.load(pki, "server"), "127.0.0.1:0", 3)
    address, env = f"127.0.0.1:{port}", {**os.environ, "GRPC_VERBOSITY": "NONE"}
    honest = [[sys.executable, "-m", "crosstrain.plugins.fl.synthetic", "--id", str(c)] for c in HONEST]
    poisoner = [sys.executable, str(Path(__file__).with_name("fl_poison_client.py")), "--id", str(POISONER),
                "--plan", plan]
    procs = [subprocess.Popen([*cmd, "--address", address, "--certs", str(pki)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for cmd in [*honest, poisoner]]
    try:
        summary = server.run()
        coordinator.wait_done({0, 1, 2}, timeout_s=30)
        assert [p.wait(60) for p in procs] == [0, 0, 0], [p.stdout.read() for p in procs]  # type: ignore[union-attr]
    finally:
        grpc_server.stop(grace=None)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saved = [saved_vector(server.layout, path) for path in sorted((run_dir / "global").glob("round_*.safetensors"))]
    return summary, rounds, [initial, *saved]


def saved_vector(layout, path: Path) -> np.ndarray:
    """A saved global model as the server's flat float32 vector (parameters in the model's order)."""
    tensors = load_file(str(path))
    return np.concatenate([tensors[name].reshape(-1) for name in layout.names])


def weighted_mean(ids: list[int], round_id: int, dim: int) -> np.ndarray:
    """FedAvg of the synthetic clients ``ids`` (weights 1 + id % 3, as synthetic.participate sends)."""
    w = np.array([1.0 + c % 3 for c in ids])
    return (w[:, None] * np.stack([update(0, c, round_id, dim) for c in ids])).sum(0) / w.sum()


def test_plain_mode_refuses_and_counts_a_nan_and_a_huge_update(pki, tmp_path):
    """With the defaults: NaN is never taken, 1e6 is far above fl.max_norm_ratio=10 times the median norm."""
    summary, rounds, models = federate(pki, tmp_path, "nan,huge", ["fl.secure=false", "fl.rounds=2"])
    dim = models[0].size
    assert [sorted(r["refused"]) for r in rounds] == [["2"], ["2"]]
    assert "139584 non-finite values" in rounds[0]["refused"]["2"]
    assert "update norm 1e+06 is above fl.max_norm_ratio=10 times the round's median 3.7" in rounds[1]["refused"]["2"]
    assert [r["survivors"] for r in rounds] == [HONEST, HONEST] and all(r["aborted"] is None for r in rounds)
    assert summary["refused_updates"] == 2 and summary["rejected_messages"] == 2
    assert summary["dropped_clients"] == [POISONER]
    for r in range(2):  # each round applied exactly the two honest clients' FedAvg mean
        assert np.isfinite(models[r + 1]).all()
        np.testing.assert_allclose(models[r + 1], models[r] + weighted_mean(HONEST, r, dim), rtol=0, atol=2e-7)


def test_plain_median_outvotes_a_huge_update(pki, tmp_path):
    summary, rounds, models = federate(pki, tmp_path, "huge", ["fl.secure=false", "fl.rounds=1",
                                                               "fl.aggregation=median", "fl.max_norm_ratio=0"])
    dim = models[0].size
    assert rounds[0]["refused"] == {} and rounds[0]["survivors"] == [0, 1, 2]  # no bound set: it is taken part
    honest = np.stack([update(0, c, 0, dim) for c in HONEST])
    step = models[1] - models[0]  # every coordinate lands between the two honest clients' values
    assert np.isfinite(models[1]).all()
    assert np.all(step >= honest.min(0) - 1e-6) and np.all(step <= honest.max(0) + 1e-6)
    assert np.linalg.norm(step) < np.linalg.norm(honest, axis=1).max()


def test_secure_mode_refuses_or_fails_the_round_and_keeps_the_model(pki, tmp_path):
    summary, rounds, models = federate(pki, tmp_path, "nan,lying,huge", ["fl.secure=true", "fl.rounds=3",
                                                                         "fl.clip_norm=10"])
    dim = models[0].size
    assert all(np.isfinite(m).all() for m in models)
    # round 1: the NaN update shows in its reported norm, refused at the train reply; the two others aggregate
    assert "reported update norm nan" in rounds[0]["refused"]["2"] and rounds[0]["survivors"] == HONEST
    np.testing.assert_allclose(models[1], models[0] + weighted_mean(HONEST, 0, dim), rtol=0, atol=1e-6)
    # round 2: a 1e6-norm update masked under an honest-looking norm: the aggregate betrays it, the round fails
    assert rounds[1]["refused"] == {} and "secure aggregate refused" in rounds[1]["aborted"]
    assert "a client masked an update other than the one it reported" in rounds[1]["aborted"]
    np.testing.assert_array_equal(models[2], models[1])  # the previous global model, kept
    # round 3: the same update under its true norm is over fl.clip_norm, refused before SecAgg+ starts
    assert "update norm 1e+06 exceeds fl.clip_norm=10" in rounds[2]["refused"]["2"]
    np.testing.assert_allclose(models[3], models[2] + weighted_mean(HONEST, 2, dim), rtol=0, atol=1e-6)
    assert summary["failed_rounds"] == [2] and summary["refused_updates"] == 2


def test_robust_aggregates_and_the_secure_bound_closed_form():
    """Median and trimmed mean against hand-computed values; the update checks; the SecAgg+ bound is the largest
    norm plus the rounding allowance n * step * sqrt(dim) / W."""
    rows = np.array([[1.0, -4.0], [2.0, 100.0], [3.0, 0.0], [-50.0, 1.0], [4.0, 2.0]], dtype=np.float32)
    median, _ = aggregate(FLSection(secure=False, clients=5, aggregation="median"), rows, np.ones(5))
    np.testing.assert_array_equal(median, [2.0, 1.0])
    np.testing.assert_allclose(trimmed_mean(rows, 1), [(1 + 2 + 3) / 3, (0 + 1 + 2) / 3])
    trimmed, stats = aggregate(FLSection(secure=False, clients=5, aggregation="trimmed_mean", trim_fraction=0.2),
                               rows, np.ones(5))
    assert stats == {"trimmed": 1} and np.allclose(trimmed, [2.0, 1.0])
    bounded = FLSection(secure=False, clip_norm=5.0)
    assert update_problem(bounded, {}, np.array([3.0, 4.0], np.float32)) is None  # norm 5: on the bound
    assert "norm 5.08 exceeds fl.clip_norm=5" in update_problem(bounded, {}, np.array([3.0, 4.1], np.float32))
    assert "1 non-finite values of 2" in update_problem(bounded, {}, np.array([np.inf, 0.0], np.float32))
    assert "reported update norm -1" in update_problem(bounded, {"norm": -1}, None)
    assert norm_outliers({0: 1.0, 1: 2.0, 7: 21.0}, 10.0).keys() == {7}  # median 2: 21 > 20
    assert norm_outliers({0: 1.0, 1: 2.0, 7: 20.0}, 10.0) == {} and norm_outliers({0: 1.0, 7: 1e9}, 10.0) == {}
    honest = FLClient(None)  # type: ignore[arg-type]  # prepare() is the client's own step, before any channel
    clipped, weight = honest.prepare(Round(0, 1, np.zeros(2, np.float32), {"clip_norm": 1.0}),
                                     np.array([3.0, 4.0], np.float32), 2.0)
    np.testing.assert_allclose(clipped, [0.6, 0.8], rtol=1e-6)
    assert weight == 2.0  # norm bounding keeps the FedAvg weight (DP clipping sets it to 1)
    assert secure_mean_bound([1.0, 3.0], 2, 1e-3, 400, 4.0) == pytest.approx(3.0 + 2 * 1e-3 * 20 / 4.0)
