"""``crosstrain.collective.global_sums``: the sum over ranks of each value (float64), divided by how many ranks hold
the same data. Used by the RL and SFT token counts (plugins/rlhf) and the detector's foreground count
(plugins/vision/detect). And where a collective runs (``served_device``, ``all_reduce_served``): on the tensor's
device when the group serves its type, else on the host; decided from the group's backend config, not its name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from crosstrain.collective import all_reduce_served, global_sums, served_device


def test_one_process_is_the_values_over_copies_in_float64() -> None:
    values = torch.tensor([3, 7], dtype=torch.int64)
    out = global_sums(values, copies=2)
    assert out.dtype == torch.float64
    assert out.tolist() == [1.5, 3.5]
    out += 1  # a new tensor, not a view of the input
    assert values.tolist() == [3, 7]


def _sums(collective: Any) -> list[list[float]]:
    rank = collective.rank
    values = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], dtype=torch.float32, requires_grad=True)
    return [global_sums(values).tolist(), global_sums(values, copies=2).tolist()]


def test_two_ranks_sum_and_divide_by_copies() -> None:
    """Rank r holds (r + 1, 10 (r + 1)): on 2 real ranks the sums are (3, 30), halved when both ranks are copies."""
    import shared_ranks

    for summed, halved in shared_ranks.run(_sums):
        assert summed == [3.0, 30.0]
        assert halved == [1.5, 15.0]


def _placement(collective: Any) -> tuple[dict[str, list[str]], list[float], bool]:
    import torch.distributed as dist

    host_only = dist.new_group(backend="cpu:gloo")
    devices = (torch.device("cpu"), torch.device("cuda", 1), torch.device("meta"))
    where = {"gloo": [str(served_device(d)) for d in devices],
             "cpu:gloo": [str(served_device(d, host_only)) for d in devices]}
    mine = torch.tensor([float(collective.rank), -float(collective.rank)])
    top = all_reduce_served(mine, dist.ReduceOp.MAX, host_only)
    dist.destroy_process_group(host_only)
    return where, top.tolist(), top is mine


def test_collectives_run_where_the_group_serves_the_device() -> None:
    """A plain gloo group serves cpu and cuda (gloo stages CUDA tensors through the host itself) and nothing else;
    a ``cpu:gloo`` group only the host. A tensor the group serves is reduced in place."""
    import shared_ranks

    for where, top, in_place in shared_ranks.run(_placement):
        assert where == {"gloo": ["cpu", "cuda:1", "cpu"], "cpu:gloo": ["cpu", "cpu", "cpu"]}
        assert top == [1.0, 0.0] and in_place


def _staged(collective: Any) -> tuple[str, str, list[float]]:
    import torch.distributed as dist

    host_only = dist.new_group(backend="cpu:gloo")
    mine = torch.tensor([1.0 + collective.rank, 10.0]).to("simdev")
    total = all_reduce_served(mine, group=host_only)
    dist.destroy_process_group(host_only)
    return str(served_device(mine.device)), total.device.type, total.cpu().tolist()


def test_a_device_tensor_the_group_does_not_serve_is_reduced_on_the_host_and_returned() -> None:
    """simdev's own group (``cpu:gloo,simdev:simgloo``) serves its tensors; a ``cpu:gloo`` group does not, so the
    sum runs on a host copy and comes back to the device, on 2 real simdev ranks."""
    from simdev_env import PROBLEM

    from crosstrain.testing.multiprocess import run_ranks

    if PROBLEM is not None:
        pytest.skip(PROBLEM)
    for own, device, total in run_ranks(_staged, 2, backend="simdev"):
        assert own == "simdev:0" and device == "simdev" and total == [3.0, 20.0]
