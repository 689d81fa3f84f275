"""FL transport (plugins/fl): gRPC over mutual TLS, who may join, the frame checks (tampered, replayed,
wrong-round, late, impersonating), plain and secure rounds over the network against the exact weighted mean,
and the server resuming at the last completed round from its checkpoint files."""

from __future__ import annotations

import json
import threading

import grpc
import numpy as np
import pytest

from crosstrain.config import load_config
from crosstrain.plugins.fl import certs, framing
from crosstrain.plugins.fl.config import FLSection
from crosstrain.plugins.fl.coordinator import Coordinator
from crosstrain.plugins.fl.framing import TransportError
from crosstrain.plugins.fl.grpc_transport import GrpcChannel, Unreachable, serve
from crosstrain.plugins.fl.inprocess import InProcessChannel
from crosstrain.plugins.fl.rounds import run_round
from crosstrain.plugins.fl.synthetic import participate, update


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    base = tmp_path_factory.mktemp("pki")
    return certs.generate(base / "run", 3), certs.generate(base / "other", 1)


def exact_mean(ids, round_id, dim, seed=0):
    w = np.array([1.0 + c % 3 for c in ids])
    u = np.stack([update(seed, c, round_id, dim) for c in ids])
    return (w[:, None] * u).sum(0) / w.sum()


def test_mutual_tls_frames_and_rounds(pki):
    ours, other = pki
    coordinator = Coordinator()
    server, port = serve(coordinator, certs.load(ours, "server"), "127.0.0.1:0", 4)
    target = f"127.0.0.1:{port}"
    try:
        # a certificate from another CA, no certificate, and the server's own certificate are all refused
        stranger = GrpcChannel(target, certs.load(other, "client-0"), timeout_s=5)
        with pytest.raises(Unreachable):
            stranger.next({"stage_seq": 0})
        ca_only = grpc.ssl_channel_credentials(root_certificates=certs.load(ours, "server").ca)
        bare = grpc.secure_channel(target, ca_only)
        with pytest.raises(grpc.RpcError) as refused:
            bare.unary_unary("/crosstrain.fl.Federation/Next")(framing.encode({}), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        posing = GrpcChannel(target, certs.load(ours, "server"), timeout_s=5)  # a server-only (EKU) certificate
        with pytest.raises(Unreachable):
            posing.next({"stage_seq": 0})
        assert coordinator.seen == {}  # none of them got as far as the coordinator
        for channel in (stranger, bare, posing):
            channel.close()

        good = GrpcChannel(target, certs.load(ours, "client-1"), timeout_s=5)
        with pytest.raises(TransportError, match="certificate is client-1"):  # the id comes from the certificate
            good.next({"stage_seq": 0, "client": 2})
        coordinator.open_stage(0, "train", {1: b"global"}, {"dim": 0})
        header, payload = good.next({"stage_seq": 0})
        assert (header["client"], header["stage"], payload) == (1, "train", b"global")
        reply = {"round": 0, "stage": "train", "stage_seq": header["stage_seq"], "seq": 1, "weight": 1, "loss": 0}
        for wrong, why in ((dict(reply, round=5), "round/stage/number"), (dict(reply, stage_seq=99), "round/stage")):
            with pytest.raises(TransportError, match=why):
                good.reply(wrong, b"u")
        frame = bytearray(framing.encode(reply, b"update"))
        frame[-1] ^= 1  # tampered in flight
        with pytest.raises(grpc.RpcError, match="sha256"):
            good._reply(bytes(frame), timeout=5)
        good.reply(reply, b"update")
        with pytest.raises(TransportError, match="replayed"):
            good.reply(reply, b"update")
        with pytest.raises(TransportError, match="already replied"):
            good.reply(dict(reply, seq=2), b"update")
        assert coordinator.wait(1.0)[1][1] == b"update"
        with pytest.raises(TransportError, match="no stage is open"):  # late: the stage has closed
            good.reply(dict(reply, seq=3), b"late")
        assert coordinator.rejected == 6

        # whole rounds over TLS with three clients: plain equals the weighted mean, secure within a grid step
        dim = 2000
        threads = [threading.Thread(target=participate, args=(GrpcChannel(target, certs.load(ours, f"client-{c}")), 0))
                   for c in range(3)]
        for t in threads:
            t.start()
        ids = coordinator.wait_for_clients(3, 30, within_s=30)
        assert ids == [0, 1, 2]
        zero = np.zeros(dim, np.float32)
        plain = run_round(coordinator, FLSection(clients=3, secure=False, stage_timeout_s=30), 0, zero, ids,
                          np.random.default_rng())
        np.testing.assert_allclose(plain.mean, exact_mean(ids, 0, dim), rtol=0, atol=1e-8)
        secure = run_round(coordinator, FLSection(clients=3, secure=True, stage_timeout_s=30), 1, zero, ids,
                           np.random.default_rng())
        assert secure.error == "" and secure.survivors == ids and secure.stats["overflowed"] == 0
        step = 2 * secure.stats["clip"] / ((2 ** secure.stats["bits"] - 1) // 3)
        assert np.abs(secure.mean - exact_mean(ids, 1, dim)).max() <= step
        assert secure.loss == pytest.approx(np.average(ids, weights=[1.0 + c % 3 for c in ids]))
        coordinator.finish()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
    finally:
        server.stop(grace=None)


def test_server_resumes_at_last_completed_round(tmp_path):
    """Two rounds, then a new server on the same run dir: it starts at round 3 from the saved global model."""
    from crosstrain.plugins.fl.server import FLServer

    config = load_config(None, ["fl.secure=false", "fl.clients=2", "fl.rounds=2", "fl.stage_timeout_s=20",
                                "fl.keep_last=2", "fl.server_lr=0.5"])

    def serve_rounds(cfg):
        coordinator = Coordinator()
        server = FLServer(cfg, tmp_path, coordinator)
        start = server.global_vec.copy()
        threads = [threading.Thread(target=participate, args=(InProcessChannel(coordinator, c, poll_s=0.5), 0))
                   for c in range(2)]
        for t in threads:
            t.start()
        summary = server.run()
        for t in threads:
            t.join(20)
        return server, start, summary

    first, initial, summary = serve_rounds(config)
    dim = first.layout.dim
    after_two = initial + 0.5 * (exact_mean([0, 1], 0, dim) + exact_mean([0, 1], 1, dim))  # fl.server_lr
    np.testing.assert_allclose(first.global_vec, after_two, atol=1e-6)
    assert summary["rounds"] == 2 and summary["resumed_from_round"] == 0
    assert summary["final_loss"] == pytest.approx(2 / 3)  # weights 1, 2 and losses 0, 1
    config.section("fl").rounds = 3
    second, resumed, summary = serve_rounds(config)
    np.testing.assert_array_equal(resumed, first.global_vec)  # read back from round_000002.safetensors
    np.testing.assert_allclose(second.global_vec, after_two + 0.5 * exact_mean([0, 1], 2, dim), atol=1e-6)
    assert summary["rounds"] == 3 and summary["resumed_from_round"] == 2 and summary["dropped_clients"] == []
    rounds = [json.loads(line)["round"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "global").glob("*.safetensors")) == [
        "round_000002.safetensors", "round_000003.safetensors"]
    (tmp_path / "global" / "round_000003.safetensors").write_bytes(b"damaged")
    from crosstrain.errors import CheckpointError

    with pytest.raises(CheckpointError, match="does not match the SHA-256"):
        FLServer(config, tmp_path, Coordinator())


def test_dp_noise_min_clients_and_fedprox():
    """Central and distributed DP give the mean of the clipped updates plus noise of std z C / n; a round with
    fewer than fl.min_clients replies fails; FedProx's term is mu/2 ||w - w_global||^2 on the client's loss."""
    from crosstrain.plugins.fl.dp import clip_update
    from crosstrain.plugins.fl.dp import epsilon as rdp_epsilon
    from crosstrain.plugins.fl.server import epsilon

    n, dim, clip, z = 3, 20000, 0.5, 2.0
    clipped = np.mean([clip_update(update(0, c, 0, dim), clip)[0] for c in range(n)], axis=0)
    for mode in ("central", "distributed"):
        coordinator = Coordinator()
        threads = [threading.Thread(target=participate, args=(InProcessChannel(coordinator, c, poll_s=0.5), 0))
                   for c in range(n)]
        for t in threads:
            t.start()
        fl = FLSection(clients=n, secure=False, dp_clip=clip, dp_noise=z, dp_mode=mode, stage_timeout_s=20)
        out = run_round(coordinator, fl, 0, np.zeros(dim, np.float32), list(range(n)), np.random.default_rng(1))
        coordinator.finish()
        for t in threads:
            t.join(20)
        noise = out.mean - clipped
        assert out.total_weight == n  # unit weights under DP
        assert abs(noise.mean()) < 0.02 and noise.std() == pytest.approx(z * clip / n, rel=0.05), mode
    assert epsilon(fl, 4) == rdp_epsilon(z, 4, fl.dp_delta) and epsilon(FLSection(secure=False), 4) is None

    coordinator = Coordinator()  # client 1 never answers: 1 of 2 replies < min_clients = 2
    thread = threading.Thread(target=participate, args=(InProcessChannel(coordinator, 0, poll_s=0.5), 0))
    thread.start()
    out = run_round(coordinator, FLSection(clients=2, secure=False, min_clients=2, stage_timeout_s=0.5), 0,
                    np.zeros(10, np.float32), [0, 1], np.random.default_rng())
    coordinator.finish()
    thread.join(20)
    assert out.mean is None and out.dropped == [1] and "fl.min_clients=2" in out.error

    import torch

    from crosstrain.data import TokenBatch
    from crosstrain.engine.aux_loss import collect_aux_losses
    from crosstrain.plugins.fl.client import Round
    from crosstrain.plugins.fl.globalstate import Layout
    from crosstrain.plugins.fl.training import FLClientRecipe
    from crosstrain.recipes.lm import build_model

    config = load_config(None, ["train.seq_len=16"])
    model = build_model(config)
    recipe = FLClientRecipe(None, 1)  # type: ignore[arg-type]
    layout = Layout(model)
    anchor = layout.flatten(model)
    recipe.layout, recipe.round = layout, Round(0, 1, anchor + 0.01, {"fedprox_mu": 0.3, "local_steps": 1})
    recipe._load(model)  # the global model is anchor + 0.01 everywhere
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # local = global + 0.01
    batch = TokenBatch(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    with collect_aux_losses() as aux:
        recipe.loss({"model": model}, batch)
    assert aux["fedprox"].item() == pytest.approx(0.3 / 2 * layout.dim * 0.01**2, rel=1e-3)


def test_missing_fl_extra_is_a_one_line_error(tmp_path, monkeypatch, capsys) -> None:
    import importlib.util

    from crosstrain.cli.main import main

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "grpc" else real_find_spec(name, *a))
    assert main(["fl", "certs", str(tmp_path / "certs"), "--clients", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['crosstrain: error: crosstrain fl needs grpcio (not installed); '
                   'run: pip install "crosstrain[fl]"']
    assert not (tmp_path / "certs").exists()
