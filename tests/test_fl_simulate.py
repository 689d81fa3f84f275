"""FL end to end with real processes on 127.0.0.1: `crosstrain fl simulate --clients 4` trains the tiny GPT to
within 10% of centralised training on the same data and steps; ten client processes, three SIGKILLed in the
middle of a secure round (the round completes), then more (the next round aborts, naming the reason)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from crosstrain.cli.main import main
from crosstrain.config import load_config
from crosstrain.plugins.fl import certs
from crosstrain.plugins.fl.config import FLSection
from crosstrain.plugins.fl.coordinator import Coordinator
from crosstrain.plugins.fl.grpc_transport import serve
from crosstrain.plugins.fl.rounds import run_round
from crosstrain.plugins.fl.synthetic import update

TINY = ["train.seq_len=64", "train.batch_size=8", "fl.rounds=3", "fl.local_steps=10", "logging.progress=none",
        "logging.tensorboard=false",
        # upper bounds only (a healthy run never waits them out): four client processes importing torch on a
        # loaded 2-core machine can take minutes to join
        "fl.join_timeout_s=900", "fl.stage_timeout_s=900"]


def held_out_loss(config, tensors: dict[str, torch.Tensor]) -> float:
    """Mean next-token loss of ``tensors`` (the GPT's weights) on the held-out split of the embedded corpus."""
    from crosstrain.recipes.lm import LMRecipe, build_model, next_token_loss

    recipe = LMRecipe()
    recipe.validate(config)
    model = build_model(config)
    model.load_state_dict(tensors)
    model.eval()
    data = recipe.eval_dataset
    with torch.no_grad():
        losses = [next_token_loss(model(b.inputs), b.targets).item() for b in
                  (data.batch(np.arange(i, min(i + 16, len(data)))) for i in range(0, len(data), 16))]
    return float(np.mean(losses))


def test_simulate_four_clients_matches_centralised(tmp_path, capsys):
    from safetensors.torch import load_file

    from crosstrain.engine.trainer import Trainer

    run = tmp_path / "fl"
    overrides = [arg for item in TINY for arg in ("--set", item)]
    assert main(["fl", "simulate", "--clients", "4", "--run-dir", str(run), *overrides]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ok"] and summary["rounds"] == 3 and summary["clients"] == 4 and summary["dropped_clients"] == []
    assert summary["secure"] is True and summary["final_loss"] < summary["initial_loss"]  # SecAgg+ by default
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3] and all(r["survivors"] == [0, 1, 2, 3] for r in rounds)
    assert all(r["overflowed"] == 0 and r["aborted"] is None for r in rounds)
    for i in range(4):  # every client trained all rounds on its own shard and wrote its own files
        client = json.loads((run / "clients" / f"client-{i}" / "summary.json").read_text())
        assert client["client"] == i and client["rounds"] == 3 and client["dropped_rounds"] == []
        events = (run / "clients" / f"client-{i}" / "train" / "events.jsonl").read_text().splitlines()
        fl_rounds = [e for e in map(json.loads, events) if e["event"] == "fl_round"]  # via the loop's metrics hub
        assert [(e["round"], e["step"]) for e in fl_rounds] == [(1, 10), (2, 20), (3, 30)]
        assert all(e["loss"] > 0 and e["update_norm"] > 0 for e in fl_rounds)
    config = load_config(None, TINY)
    fl_model = load_file(str(run / "global" / "round_000003.safetensors"))

    central = load_config(None, [*TINY, "train.steps=30", "eval.every=0", "checkpoint.final=false"])
    trainer = Trainer(central, tmp_path / "central")
    trainer.fit()
    fl_loss = held_out_loss(config, fl_model)
    central_loss = held_out_loss(config, trainer.final_state_dict)
    print(f"held-out loss: federated {fl_loss:.4f}, centralised {central_loss:.4f}")
    assert fl_loss <= 1.10 * central_loss


class KillingCoordinator(Coordinator):
    """Delivers SIGKILL to the given client processes just before a named stage opens (a crash mid-round)."""

    def __init__(self) -> None:
        super().__init__()
        self.kill_at: dict[tuple[int, str], list[subprocess.Popen]] = {}

    def open_stage(self, round_id, name, requests, meta=None, validate=None):
        for proc in self.kill_at.pop((round_id, name), []):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        super().open_stage(round_id, name, requests, meta, validate)


def test_secure_round_survives_three_sigkilled_clients(tmp_path):
    pki = certs.generate(tmp_path / "certs", 10)
    coordinator = KillingCoordinator()
    server, port = serve(coordinator, certs.load(pki, "server"), "127.0.0.1:0", 10)
    env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
    procs = {c: subprocess.Popen([sys.executable, "-m", "crosstrain.plugins.fl.synthetic", "--address",
                                  f"127.0.0.1:{port}", "--certs", str(pki), "--id", str(c)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for c in range(10)}
    try:
        ids = coordinator.wait_for_clients(10, 900, within_s=900)
        assert ids == list(range(10))
        fl = FLSection(clients=10, secure=True, stage_timeout_s=4.0)
        dim = 2000
        zero = np.zeros(dim, np.float32)
        coordinator.kill_at[(0, "masked")] = [procs[c] for c in (2, 5, 7)]  # after sharing their secrets
        first = run_round(coordinator, fl, 0, zero, ids, np.random.default_rng(0))
        alive = [c for c in ids if c not in (2, 5, 7)]
        assert first.error == "" and first.survivors == alive and first.dropped == [2, 5, 7]
        w = np.array([1.0 + c % 3 for c in alive])
        exact = (w[:, None] * np.stack([update(0, c, 0, dim) for c in alive])).sum(0) / w.sum()
        step = 2 * first.stats["clip"] / ((2 ** first.stats["bits"] - 1) // 10)
        assert first.stats["clipped"] == 0 and first.stats["overflowed"] == 0
        assert np.abs(first.mean - exact).max() <= step and first.total_weight == pytest.approx(w.sum())

        # round 2 with the seven survivors (s=6, t=4): four more die before sharing, so 3 < t are left
        coordinator.kill_at[(1, "share")] = [procs[c] for c in alive[:4]]
        second = run_round(coordinator, fl, 1, zero, alive, np.random.default_rng(0))
        assert second.mean is None and "secure aggregation aborted" in second.error
        assert "needs t=4" in second.error, second.error
        coordinator.finish()
        for c in alive[4:]:  # the last three were told the run is over and left cleanly
            assert procs[c].wait(30) == 0
    finally:
        coordinator.finish()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        server.stop(grace=None)
