"""Collective interface conformance on two real processes."""

from __future__ import annotations

import pytest
import torch

from crosstrain.collective import Collective
from crosstrain.testing.conformance.collective_checks import check_all
from crosstrain.testing.multiprocess import run_ranks

WORLD = 2


@pytest.fixture(scope="module")
def observed(backend, device):
    if device.type != "cpu" and device.device_count() < WORLD:
        pytest.skip(f"collectives need {WORLD} devices; {device.device_count()} visible")
    return run_ranks(check_all, WORLD, backend=backend.name)


def test_all_reduce(observed):
    for o in observed:
        assert o["all_reduce_sum"] == [3.0] * 5
        assert o["all_reduce_max"] == [2.0] * 3
        assert o["all_reduce_avg_or_sum"] in ([1.5] * 3, [3.0] * 3)


def test_all_gather_and_reduce_scatter(observed):
    for o in observed:
        assert o["all_gather"] == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
        r = o["rank"]
        # sum over ranks of arange(4) * (rank + 1) = arange(4) * 3, rank r keeps slice [2r, 2r+2)
        assert o["reduce_scatter"] == [3.0 * (2 * r), 3.0 * (2 * r + 1)]


def test_broadcast(observed):
    assert all(o["broadcast"] == [float(WORLD - 1)] * 3 for o in observed)


def test_all_to_all_even(observed):
    for o in observed:
        r = o["rank"]
        assert o["all_to_all"] == [float(100 * s + r) for s in range(WORLD)]


def test_all_to_all_uneven(observed):
    for o in observed:
        r = o["rank"]
        expected_splits = [s + 1 + r for s in range(WORLD)]
        assert o["uneven_splits"] == expected_splits
        expected_rows = [float(100 * s + r) for s in range(WORLD) for _ in range(s + 1 + r)]
        assert o["uneven_rows"] == expected_rows
        assert "splits sum to" in o["uneven_bad_sum"]


def test_async_send_recv_barrier_objects(observed):
    assert all(o["async_ok"] for o in observed)
    assert observed[1]["recv"] == [42.0]
    assert observed[0]["exchange"] == [8.0] * 3 and observed[1]["exchange"] == [7.0] * 3
    assert all(o["objects"] == [{"rank": 0}, {"rank": 1}] for o in observed)


def test_mesh(observed):
    for o in observed:
        assert o["mesh"] == {"names": ["dp_shard"], "shape": [WORLD]}
        assert "world size is 2" in o["mesh_error"]


def test_single_process_mode_is_identity(backend, device):
    from crosstrain.distenv import DistEnv

    c = Collective(device, DistEnv())
    c.init()
    dev = device.current_device()
    t = torch.arange(4.0, device=dev)
    c.all_reduce(t)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    out = torch.empty(4, device=dev)
    c.all_gather(out, t)
    assert out.tolist() == t.tolist()
    received, splits = c.all_to_all_uneven(t, [4])
    assert received.tolist() == t.tolist() and splits == [4]
    assert c.world_size == 1 and c.rank == 0
