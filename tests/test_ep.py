"""Expert parallelism: ``parallel.ep`` carved from ``dp_shard`` (dims, one-line errors), the protocol check, and on
2 real gloo processes with ep=2: the ep sub-mesh, distinct data per ep rank, the GPT (no experts) refused, and a
tiny two-expert module (one expert per rank, tokens exchanged with all_to_all_autograd) matching one process."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import shared_ranks
import torch
from one_line import raises_one_line
from torch import nn

from crosstrain import kernels
from crosstrain.errors import ConfigError
from crosstrain.parallel import (
    ExpertParallel,
    ParallelDims,
    all_to_all_autograd,
    all_to_all_uneven_autograd,
    apply_ep,
    check_expert_model,
)

DIM = 4
TOKENS = 7  # per rank
TOL = 1e-5


class TinyExperts(nn.Module):
    """Two experts (``nn.Linear`` each); a token goes to expert 1 when its first feature is > 0.3, else 0.

    After :meth:`apply_expert_parallel` on an ep mesh of 2, rank ``r`` holds expert ``r`` and exchanges tokens
    with :func:`all_to_all_autograd` (a test fixture, not the MoE plugin).
    """

    num_experts = 2

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(self.num_experts))
        self.group: Any = None

    def apply_expert_parallel(self, ep_mesh: Any) -> None:
        assert ep_mesh.size() == self.num_experts, "one expert per rank in this fixture"
        self.experts = nn.ModuleList([self.experts[ep_mesh.get_local_rank()]])
        self.group = ep_mesh.get_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert = (x[:, 0] > 0.3).long()
        permuted, order, counts = kernels.moe_permute(x, expert[:, None], self.num_experts)
        if self.group is None:
            out = torch.cat([self.experts[e](rows) for e, rows in enumerate(torch.split(permuted, counts.tolist()))])
        else:  # counts[e] rows go to rank e; the rows that come back are in the order they were sent
            received, splits = all_to_all_uneven_autograd(permuted, counts, self.group)
            out = all_to_all_autograd(self.experts[0](received), counts.tolist(), splits, self.group)
        return kernels.moe_unpermute(out, order, torch.ones(x.shape[0], 1, dtype=x.dtype))


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(TOKENS, DIM, generator=g), torch.randn(TOKENS, DIM, generator=g)


def _experts() -> TinyExperts:
    torch.manual_seed(0)
    return TinyExperts()


# -- one process ------------------------------------------------------------------------------------------------
def test_ep_is_carved_from_dp_shard():
    dims = ParallelDims(ep=2, world_size=4).resolve()
    assert (dims.dp_shard, dims.dp_degree, dims.ep_enabled) == (4, 4, True)
    assert dims.mesh_shape() == {"pp": 1, "dp_replicate": 1, "dp_shard_out": 2, "ep": 2, "tp": 1}
    hsdp = ParallelDims(dp_replicate=2, dp_shard=2, ep=2, world_size=4).resolve()
    assert hsdp.mesh_shape() == {"pp": 1, "dp_replicate": 2, "dp_shard_out": 1, "ep": 2, "tp": 1}
    assert ParallelDims(world_size=2).resolve().mesh_shape() == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "ep": 1,
                                                                 "tp": 1}
    raises_one_line(lambda: ParallelDims(dp_shard=4, ep=3, world_size=4).resolve(),
                    "parallel.ep=3 must divide parallel.dp_shard=4", "pick a divisor")
    raises_one_line(lambda: ParallelDims(dp_shard=1, tp=2, ep=2, world_size=2).resolve(),
                    "parallel.ep=2 must divide parallel.dp_shard=1")
    raises_one_line(lambda: ParallelDims(ep=0, world_size=2).resolve(), "parallel.ep=0")


def test_config_accepts_ep_and_checks_it_against_the_world():
    from crosstrain.config.loader import check_world, load_config

    assert check_world(load_config(None, ["parallel.ep=2", "moe.experts=2", "train.batch_size=8"]), 2).ep == 2
    raises_one_line(lambda: check_world(load_config(None, ["parallel.ep=2", "parallel.dp_shard=1",
                                                           "parallel.tp=2"]), 2), "parallel.ep=2 must divide")


def test_protocol_and_the_no_experts_error():
    from crosstrain.models.gpt import build_gpt

    assert isinstance(TinyExperts(), ExpertParallel) and not isinstance(nn.Linear(2, 2), ExpertParallel)
    check_expert_model(build_gpt("tiny"), ParallelDims(world_size=1).resolve())  # ep=1: anything goes
    check_expert_model(nn.Sequential(TinyExperts()), ParallelDims(ep=2, world_size=2).resolve())
    raises_one_line(lambda: check_expert_model(build_gpt("tiny"), ParallelDims(ep=2, world_size=2).resolve()),
                    "parallel.ep=2", "GPT", "apply_expert_parallel")

    class Recorder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.meshes: list[Any] = []

        def apply_expert_parallel(self, ep_mesh: Any) -> None:
            self.meshes.append(ep_mesh)

    model = nn.Sequential(Recorder(), nn.Sequential(Recorder()))
    apply_ep(model, "the-ep-mesh")
    assert [m.meshes for m in model.modules() if isinstance(m, Recorder)] == [["the-ep-mesh"], ["the-ep-mesh"]]


# -- two processes ------------------------------------------------------------------------------------------------
def _ep_rank(collective: Any) -> dict[str, Any]:
    from crosstrain.data import DistributedBatchSampler
    from crosstrain.models.gpt import build_gpt
    from crosstrain.parallel import build_mesh, dp_mesh, dp_rank_and_size, ep_mesh, fsdp_mesh, parallelize

    dims = ParallelDims(dp_shard=2, ep=2, world_size=collective.world_size).resolve()
    mesh = build_mesh(collective, dims)
    with warnings.catch_warnings():  # torch deprecates slicing a flattened dim from the root; it still works
        warnings.simplefilter("ignore")
        legacy = mesh["dp_shard"].mesh.tolist()
    dp_rank, dp_size = dp_rank_and_size(mesh, dims)
    # as the trainer builds it (core/engine/trainer.py)
    sampler = DistributedBatchSampler(64, 8, dp_rank=dp_rank, dp_size=dp_size, micro_batches=2, seed=0)
    try:
        parallelize(build_gpt("tiny"), dims, mesh, torch.device("cpu"))
        gpt_error = ""
    except ConfigError as exc:
        gpt_error = str(exc)

    experts = _experts()
    apply_ep(experts, ep_mesh(mesh, dims))
    x, up = _tokens(collective.rank)
    x = x.clone().requires_grad_()
    out = experts(x)
    (out * up).sum().backward()
    expert = experts.experts[0]
    return {
        "names": mesh.mesh_dim_names, "ep": ep_mesh(mesh, dims).mesh.tolist(), "dp": dp_mesh(mesh, dims).mesh.tolist(),
        "fsdp": fsdp_mesh(mesh, dims).mesh.tolist(), "legacy_dp_shard": legacy, "dp_rank": (dp_rank, dp_size),
        "batches": [[int(i) for i in micro] for micro in sampler.next_step()], "gpt_error": gpt_error,
        "out": out.detach().numpy(), "x_grad": x.grad.numpy(),
        "w_grad": expert.weight.grad.numpy(), "b_grad": expert.bias.grad.numpy(),
    }


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return shared_ranks.run(_ep_rank)


def test_mesh_has_an_ep_sub_mesh_and_the_flattened_dp_shard(per_rank):
    for rank, got in enumerate(per_rank):
        assert got["names"] == ("pp", "dp_replicate", "dp_shard_out", "ep", "tp")
        assert got["ep"] == got["dp"] == got["fsdp"] == got["legacy_dp_shard"] == [0, 1]
        assert got["dp_rank"] == (rank, 2)


def test_ep_ranks_read_different_batches(per_rank):
    first, second = (set(sum(got["batches"], [])) for got in per_rank)
    assert len(first) == len(second) == 4 and not first & second


def test_gpt_without_experts_is_araises_one_line(per_rank):
    for got in per_rank:
        text = got["gpt_error"]
        assert "parallel.ep=2" in text and "GPT" in text and "\n" not in text


def test_expert_parallel_forward_backward_matches_one_process(per_rank):
    model = _experts()
    xs, ups = zip(*(_tokens(r) for r in range(2)), strict=True)
    x = torch.cat(xs).requires_grad_()
    out = model(x)
    (out * torch.cat(ups)).sum().backward()
    routed = (x[:, 0] > 0.3).long()
    assert 0 < int(routed.sum()) < x.shape[0]  # both experts get tokens, unevenly
    for rank, got in enumerate(per_rank):
        rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
        torch.testing.assert_close(torch.from_numpy(got["out"]), out[rows].detach(), rtol=TOL, atol=TOL)
        torch.testing.assert_close(torch.from_numpy(got["x_grad"]), x.grad[rows], rtol=TOL, atol=TOL)
        # rank r holds expert r: its gradient collects the tokens of both ranks routed to it
        torch.testing.assert_close(torch.from_numpy(got["w_grad"]), model.experts[rank].weight.grad, rtol=TOL, atol=TOL)
        torch.testing.assert_close(torch.from_numpy(got["b_grad"]), model.experts[rank].bias.grad, rtol=TOL, atol=TOL)
