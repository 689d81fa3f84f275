"""SecAgg+ (plugins/fl/secagg) in one process: the secure round against the plain aggregate (exactly, with
dropouts at every stage, on dense and sparse graphs, 32- and 64-bit words), aborts that name the client, the
masked vector's independence from the update, rejection of tampered / replayed / wrong-round messages, the
quantiser's closed forms and the planner."""

from __future__ import annotations

import base64
import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from crosstrain.errors import ConfigError
from crosstrain.plugins.fl.secagg import (
    STAGES,
    ClientSession,
    ProtocolError,
    SecAggAbort,
    SecAggParams,
    ServerSession,
    crypto,
    plain_aggregate,
    run_round_inprocess,
    shamir,
    wire,
)
from crosstrain.plugins.fl.secagg.quantise import dequantise, quantise

N, DIM = 10, 300
DENSE = SecAggParams(N, 8, 5, 28, clip=0.5)


def updates(seed: int = 0) -> tuple[dict[int, np.ndarray], dict[int, float]]:
    rng = np.random.default_rng(seed)
    vectors = {c: rng.normal(0, 0.2, DIM).astype(np.float32) for c in range(N)}
    vectors[3][:7] = 5.0  # 7 coordinates beyond the clip range (after any weight >= 0.1)
    weights = {c: float(rng.uniform(0.1, 1.0)) for c in range(N)}
    return vectors, weights


def clients_for(round_id: int, params: SecAggParams, vectors, weights) -> dict[int, ClientSession]:
    return {c: ClientSession(c, round_id, params, vectors[c], weights[c], rounding_seed=100 + c) for c in vectors}


def advance(server: ServerSession, clients: dict[int, ClientSession], stages: tuple[str, ...]) -> None:
    for stage in stages:
        for cid, request in server.requests(stage).items():
            server.accept(stage, cid, clients[cid].respond(stage, request))
        server.close_stage(stage)


# -- the secure sum is the plain sum ------------------------------------------------------------------------------
@pytest.mark.parametrize("params, drop_before", [
    (DENSE, {}),
    (DENSE, {"advertise": {2, 5, 8}}),
    (DENSE, {"share": {0, 4, 9}}),  # after advertise
    (DENSE, {"masked": {1, 3, 6}}),  # after share: their pairwise masks are rebuilt and removed
    (DENSE, {"unmask": {2, 3, 7}}),  # after masked: still survivors, their self masks rebuilt
    (DENSE, {"share": {0}, "masked": {1}, "unmask": {2}}),
    (SecAggParams(N, 4, 3, 28, clip=0.5), {"masked": {6}}),  # SecAgg+'s sparse graph
    (SecAggParams(N, 9, 5, 44, clip=0.5), {"masked": {0, 9}}),  # 64-bit words, complete graph
])
def test_secure_round_equals_plain_aggregate_exactly(params, drop_before):
    vectors, weights = updates()
    result = run_round_inprocess(ServerSession(7, params, list(range(N))), clients_for(7, params, vectors, weights),
                                 drop_before)
    gone = set().union(*drop_before.values()) if drop_before else set()
    survivors = sorted(set(range(N)) - gone | drop_before.get("unmask", set()))
    assert result.survivors == survivors and result.dropped == sorted(set(range(N)) - set(survivors))
    reference = plain_aggregate([vectors[c] for c in survivors], [weights[c] for c in survivors], params,
                                [100 + c for c in survivors])
    assert result.mean.dtype == np.float32 and np.array_equal(result.mean, reference)
    # and the plain aggregate is the weighted FedAvg mean of the clipped updates, to the grid's resolution
    w = np.array([weights[c] for c in survivors])
    scaled = np.stack([vectors[c] for c in survivors]).astype(np.float64) * w[:, None]
    clipped = np.clip(scaled, -0.5, 0.5)
    step = 2 * params.clip / params.levels
    assert np.abs(result.mean - clipped.sum(0) / w.sum()).max() < 4 * step * len(survivors) / w.sum() + 1e-7
    assert abs(result.total_weight - w.sum()) <= params.max_weight / params.levels * len(survivors)
    assert result.stats["clipped"] == np.count_nonzero(np.abs(scaled) > 0.5) >= (7 if 3 in survivors else 0)
    assert result.stats["overflowed"] == 0


def test_replies_accepted_from_many_threads_at_once():
    """A gRPC server accepts replies from a thread pool: the running sum must not lose an update."""
    vectors = {c: np.random.default_rng(c).normal(0, 0.1, 50_000).astype(np.float32) for c in range(N)}
    weights = dict.fromkeys(range(N), 1.0)
    server, clients = ServerSession(4, DENSE, list(range(N))), clients_for(4, DENSE, vectors, weights)
    with ThreadPoolExecutor(N) as pool:
        for stage in STAGES:
            replies = {c: clients[c].respond(stage, r) for c, r in server.requests(stage).items()}
            list(pool.map(lambda c: server.accept(stage, c, replies[c]), replies))  # noqa: B023
            server.close_stage(stage)
    reference = plain_aggregate(list(vectors.values()), [1.0] * N, DENSE, [100 + c for c in range(N)])
    assert np.array_equal(server.result().mean, reference)


@pytest.mark.parametrize("stage", STAGES)
def test_too_many_dropped_neighbours_aborts_naming_the_client(stage):
    params = DENSE  # s=8, t=5: at most 3 of a client's neighbours may drop
    server = ServerSession(3, params, list(range(N)))
    victim = 4
    gone = set(sorted(server.graph[victim])[:params.neighbours - params.threshold + 1])  # 4 of its neighbours
    live = set(range(N)) - gone
    # the first client (by id) left with fewer than t live neighbours, found independently of the server
    # (from masked on, the dropped sharers' mask keys must be rebuilt too)
    expected = next(c for c in sorted(live | (gone if stage in ("masked", "unmask") else set()))
                    if len(server.graph[c] & live) < params.threshold)
    vectors, weights = updates()
    with pytest.raises(SecAggAbort) as info:
        run_round_inprocess(server, clients_for(3, params, vectors, weights), {stage: gone})
    count = len(server.graph[expected] & live)
    assert f"aborted at {stage}: client {expected} has {count} live neighbours, needs t=5" in str(info.value)
    with pytest.raises(ProtocolError):  # a closed, aborted round accepts nothing more
        server.requests(stage)


# -- what the server sees -----------------------------------------------------------------------------------------
def _chi2_critical(dof: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal quantile ``z``."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_masked_vector_is_uniform_and_independent_of_the_update():
    """Client 0's masked words, for an update at +clip everywhere and one at -clip everywhere, are both uniform
    mod 2**bits and indistinguishable (Pearson chi-square on the top and bottom 8 bits, homogeneity of the two
    histograms). Thresholds sit at z = 6 (false alarm ~1e-9 per test, so never flaky); the same tests reject
    the unmasked words outright, so they can fail."""
    n, dim, params = 4, 1 << 15, SecAggParams(4, 3, 2, 24, clip=1.0)
    masked: dict[str, np.ndarray] = {}
    for name, value in (("high", 1.0), ("low", -1.0)):
        vectors = {c: np.full(dim, value if c == 0 else 0.1, np.float32) for c in range(n)}
        clients = {c: ClientSession(c, 1, params, vectors[c], 1.0, rounding_seed=c) for c in range(n)}
        server = ServerSession(1, params, list(range(n)))
        advance(server, clients, ("advertise", "share"))
        requests = server.requests("masked")
        reply = clients[0].respond("masked", requests[0])
        masked[name] = np.frombuffer(wire.peek(reply).raw("y")[:-(2 * 4)], dtype="<u4")
        for c in range(1, n):
            server.accept("masked", c, clients[c].respond("masked", requests[c]))
        server.accept("masked", 0, reply)
        server.close_stage("masked")
        advance(server, clients, ("unmask",))
        assert np.allclose(server.result().mean, (value + 0.3) / n, atol=1e-5)  # the round itself still works
        plain = clients[0].words[:-2]
    critical = _chi2_critical(255, 6.0)

    def histograms(words: np.ndarray) -> list[np.ndarray]:
        return [np.bincount(words >> 16, minlength=256), np.bincount(words & 0xFF, minlength=256)]

    for words in masked.values():
        assert words.max() < 2**24
        for hist in histograms(words):
            assert ((hist - dim / 256) ** 2 / (dim / 256)).sum() < critical
    for a, b in zip(histograms(masked["high"]), histograms(masked["low"]), strict=True):
        expected = (a + b) / 2
        assert ((a - expected) ** 2 / expected + (b - expected) ** 2 / expected).sum() < critical
    top = histograms(plain)[0]  # power check: the unmasked update is nowhere near uniform
    assert ((top - dim / 256) ** 2 / (dim / 256)).sum() > 100 * critical


# -- tampered, replayed and wrong-round messages ------------------------------------------------------------------
def _flip(data: bytes, pos: int) -> bytes:
    return data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1:]


def test_tampered_replayed_and_wrong_round_messages_are_rejected():
    vectors, weights = updates()
    params = DENSE
    server, clients = ServerSession(5, params, list(range(N))), clients_for(5, params, vectors, weights)
    later, later_clients = ServerSession(6, params, list(range(N))), clients_for(6, params, vectors, weights)
    advance(server, clients, ("advertise",))
    advance(later, later_clients, ("advertise",))

    # server side: every byte position class of a reply is covered by the tag
    requests = server.requests("share")
    reply = clients[0].respond("share", requests[0])
    for pos in (0, 6, 12, 40, len(reply) // 2, len(reply) - 1):
        with pytest.raises(ProtocolError):
            server.accept("share", 0, _flip(reply, pos))
    with pytest.raises(ProtocolError):  # a reply from round 5 offered to round 6
        later.accept("share", 0, reply)
    with pytest.raises(ProtocolError):  # from the wrong client
        server.accept("share", 1, reply)
    server.accept("share", 0, reply)  # the genuine reply still goes through after the rejected ones
    with pytest.raises(ProtocolError):  # accepted twice
        server.accept("share", 0, reply)

    # client side: tampered, replayed and other-round requests
    with pytest.raises(ProtocolError):
        clients[1].respond("share", _flip(requests[1], len(requests[1]) // 2))
    with pytest.raises(ProtocolError):
        later_clients[1].respond("share", requests[1])
    for cid in range(1, N):
        server.accept("share", cid, clients[cid].respond("share", requests[cid]))
    with pytest.raises(ProtocolError):  # the same request again
        clients[1].respond("share", requests[1])
    server.close_stage("share")
    advance(later, later_clients, ("share",))

    # routed ciphertexts: from another round, tampered, or re-addressed, behind a genuine tag (a cheating server)
    sender, other = sorted(server.graph[2] & later.graph[2])[:2]
    genuine = server._outbox[2][sender]
    raw = bytearray(base64.b64decode(genuine))
    raw[20] ^= 1
    for forged in (later._outbox[2][sender], base64.b64encode(bytes(raw)).decode(), server._outbox[2][other]):
        server._outbox[2][sender] = forged
        with pytest.raises(ProtocolError, match="share ciphertext failed authentication"):
            clients[2].respond("masked", server.requests("masked")[2])
    server._outbox[2][sender] = genuine
    masked_request = server.requests("masked")[2]
    assert json.loads(wire.peek(masked_request).raw("shares"))[str(sender)] == genuine
    clients[2].respond("masked", masked_request)

    # a cheating server asking for both secrets of one neighbour, or for a non-neighbour's, is refused
    for survivors, dropped in (([sender], [sender]), ([sender], [2]), ([], [sorted(set(range(N)) - server.graph[2]
                                                                                    - {2})[0]])):
        fields = {"survivors": wire.dumps(survivors), "dropped": wire.dumps(dropped)}
        forged = wire.encode(wire.Message("unmask", 5, wire.SERVER, 2, fields), server._mac[2])
        with pytest.raises(ProtocolError, match="refuses to unmask"):
            clients[2].respond("unmask", forged)


def test_corrupted_messages_raise_protocol_error_and_change_nothing():
    """Random flips, truncations and extensions of every stage's request and reply are rejected with
    ProtocolError (nothing else escapes), and the round then completes exactly as if they never came."""
    vectors, weights = updates(1)
    server, clients = ServerSession(2, DENSE, list(range(N))), clients_for(2, DENSE, vectors, weights)
    rng = np.random.default_rng(0)

    def corruptions(data: bytes) -> list[bytes]:
        out = [data[:k] for k in (0, 10, 37, len(data) - 1)] + [data + b"\0", data + data[-40:]]
        return out + [_flip(data, int(p)) for p in rng.integers(0, len(data), 12)]

    for stage in STAGES:
        requests = server.requests(stage)
        for bad in corruptions(requests[0]):
            with pytest.raises(ProtocolError):
                if stage == "advertise":  # untagged: the client may answer, then the server rejects the answer
                    fresh = ClientSession(0, 2, DENSE, vectors[0], weights[0])
                    server.accept(stage, 0, fresh.respond(stage, bad))
                else:
                    clients[0].respond(stage, bad)
        for cid, request in requests.items():
            reply = clients[cid].respond(stage, request)
            if cid == 0:
                for bad in corruptions(reply):
                    with pytest.raises(ProtocolError):
                        server.accept(stage, 0, bad)
            server.accept(stage, cid, reply)
        server.close_stage(stage)
    reference = plain_aggregate(list(vectors.values()), list(weights.values()), DENSE, [100 + c for c in range(N)])
    assert np.array_equal(server.result().mean, reference)


def test_share_encryption_binds_round_and_parties():
    a, b = crypto.new_key(), crypto.new_key()
    key = crypto.agree(a, crypto.public_bytes(b), b"share", 9)
    assert key == crypto.agree(b, crypto.public_bytes(a), b"share", 9) != crypto.agree(a, crypto.public_bytes(b),
                                                                                        b"share", 10)
    sealed = crypto.seal(key, b"secret share", crypto.share_aad(9, 1, 2))
    assert crypto.open_sealed(key, sealed, crypto.share_aad(9, 1, 2)) == b"secret share"
    for aad in (crypto.share_aad(10, 1, 2), crypto.share_aad(9, 2, 1), crypto.share_aad(9, 1, 3)):
        with pytest.raises(ProtocolError):
            crypto.open_sealed(key, sealed, aad)
    with pytest.raises(ProtocolError):
        crypto.open_sealed(key, _flip(sealed, 15), crypto.share_aad(9, 1, 2))


# -- the pieces against their closed forms ------------------------------------------------------------------------
def test_shamir_threshold_and_prg():
    secret = int.from_bytes(bytes(range(32)), "big")
    shares = shamir.split(secret, [1, 2, 3, 4, 5], 3)
    assert all(shamir.combine({x: shares[x] for x in xs}) == secret for xs in ([1, 2, 3], [5, 2, 4], [1, 3, 4, 5]))
    assert shamir.combine({x: shares[x] for x in (1, 2)}) != secret
    # the PRG is AES-256-CTR: deterministic in the full 256-bit seed, different for seeds differing in one bit
    seed = bytes(31) + b"\x01"
    words = crypto.prg(seed, 1000, np.dtype(np.uint32))
    assert np.array_equal(words, crypto.prg(seed, 1000, np.dtype(np.uint32)))
    assert (words != crypto.prg(bytes(32), 1000, np.dtype(np.uint32))).mean() > 0.99
    # add_masks expands the same streams block by block (here 3 blocks and a ragged end), wrapping mod 2**64
    size, seeds = 3 * (1 << 15) + 5, [bytes([i]) * 32 for i in range(3)]
    acc = np.arange(size, dtype=np.uint64)
    crypto.add_masks(acc, [(seeds[0], True), (seeds[1], False), (seeds[2], True)])
    u64 = np.dtype(np.uint64)
    expected = np.arange(size, dtype=np.uint64) + crypto.prg(seeds[0], size, u64) - crypto.prg(seeds[1], size, u64)
    assert np.array_equal(acc, expected + crypto.prg(seeds[2], size, u64))


def test_quantiser_headroom_unbiased_rounding_and_overflow_count():
    params = SecAggParams(2, 1, 1, 8, clip=1.0)  # L = 127 steps per client, 2 clients sum below 256
    assert params.levels == 127 and 2 * params.levels < 2**8
    top = [quantise(np.full(4, 9.0), 1.0, params, s)[0] for s in (1, 2)]  # everything at +clip, counted
    assert top[0].tolist() == [127, 127, 127, 127, 127, 4]
    mean, weight, stats = dequantise(top[0] + top[1], 2, params)
    assert np.allclose(mean, 1.0) and weight == 2.0 and stats == {"clipped": 8, "overflowed": 0}
    # stochastic rounding is unbiased: E[q] = z, so the average of many roundings of 0.3 is 0.3 within 5 sigma
    x = np.full(20000, 0.3)
    words, _ = quantise(x, 1.0, params, 0)
    decoded = words[:-2].astype(np.float64) * 2 / 127 - 1
    z = (0.3 + 1) / 2 * 127  # 82.55: every word is 82 or 83
    assert set(np.unique(words[:-2]).tolist()) == {math.floor(z), math.ceil(z)}
    assert abs(decoded.mean() - 0.3) < 5 * (1 / 127) / math.sqrt(x.size)
    # a sum beyond survivors * L (impossible from honest clients) is counted, never silently used
    bad = top[0] + top[1]
    bad[1] = 255
    assert dequantise(bad, 2, params)[2]["overflowed"] == 1
    with pytest.raises(ValueError, match="non-finite"):
        quantise(np.array([1.0, np.nan]), 1.0, params, 0)
    with pytest.raises(ValueError, match="max_weight"):
        quantise(np.ones(3), 2.0, params, 0)


def test_planner_and_parameter_errors():
    params, why = SecAggParams.plan(1000, 0.1, update_norm=2.0, dim=1_000_000)
    s, t = params.neighbours, params.threshold
    assert t == s // 2 + 1 and 2 * math.ceil(math.log2(1000)) <= s < 999 and f"s={s}" in why and "t=" in why

    def risk(k: int) -> float:  # the chance some client keeps fewer than t live neighbours, by the binomial tail
        return 1000 * sum(math.comb(k, j) * 0.1**j * 0.9 ** (k - j) for j in range(k - (k // 2 + 1) + 1, k + 1))

    assert risk(s) <= 1e-3 < risk(s - 2)
    assert params.bits == 10 + 24 and 1000 * params.levels < 2**params.bits
    assert params.clip == 2.0 and "nothing clips" in why  # grid step 4 / L is far below 2**-10 of rms = 0.002
    huge, why = SecAggParams.plan(10, 0.1, update_norm=1.0, dim=10**10)  # rms 1e-5: the range shrinks
    assert huge.clip == pytest.approx(1e-5 * huge.levels / 2**11) and 2 * huge.clip / huge.levels == pytest.approx(
        1e-5 / 2**10)
    small, _ = SecAggParams.plan(10, 0.0, 1.0, 100)
    assert small.neighbours == 8 and small.threshold == 5
    for bad in (dict(expected_dropout=0.5), dict(update_norm=0.0), dict(dim=0)):
        args = dict(num_clients=10, expected_dropout=0.1, update_norm=1.0, dim=10) | bad
        with pytest.raises(ConfigError):
            SecAggParams.plan(**args)
    for fields, message in (((10, 8, 4, 28, 1.0), "threshold=4 must lie in [5, neighbours=8]"),
                            ((9, 3, 2, 28, 1.0), "must be even when num_clients=9"),
                            ((10, 8, 5, 70, 1.0), "bits=70"), ((10, 8, 5, 28, -1.0), "clip=-1.0"),
                            ((10, 10, 6, 28, 1.0), "neighbours=10")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            SecAggParams(*fields)
    assert STAGES == ("advertise", "share", "masked", "unmask")
