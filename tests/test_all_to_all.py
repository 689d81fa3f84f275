"""all_to_all_autograd on 2 real gloo processes against one process: uneven splits (zero-size ones included),
forward rows and backward gradients within 1e-6; plus the one-line errors and the single-process identity."""

from __future__ import annotations

from typing import Any

import pytest
import shared_ranks
import torch

from crosstrain.errors import CollectiveError
from crosstrain.parallel import all_to_all_autograd, all_to_all_uneven_autograd, exchange_splits

WORLD = 2
DIM = 3
TOL = 1e-6
#: per case: SPLITS[rank][dst] rows rank sends to dst. Zero-size splits, and a rank that sends nothing at all.
CASES = [
    [[2, 0], [3, 1]],
    [[0, 0], [1, 2]],
    [[1, 4], [0, 2]],
]


def _inputs(case: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``rank`` sends in ``case`` and the upstream gradient of what it receives (fixed seeds)."""
    splits = CASES[case]
    g = torch.Generator().manual_seed(100 * case + rank)
    x = torch.randn(sum(splits[rank]), DIM, generator=g, dtype=torch.float64)
    received = sum(splits[src][rank] for src in range(WORLD))
    up = torch.randn(received, DIM, generator=g, dtype=torch.float64)
    return x, up


def _reference(case: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-rank received rows and per-rank input gradients, by slicing and plain autograd in one process."""
    splits = CASES[case]
    xs, ups = zip(*(_inputs(case, r) for r in range(WORLD)), strict=True)
    leaves = [x.clone().requires_grad_() for x in xs]
    chunks = [list(torch.split(leaves[src], splits[src])) for src in range(WORLD)]
    outs = [torch.cat([chunks[src][dst] for src in range(WORLD)]) for dst in range(WORLD)]
    sum((out * up).sum() for out, up in zip(outs, ups, strict=True)).backward()
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


def _ranks(collective: Any) -> list[dict[str, Any]]:
    import torch.distributed as dist

    rank, group = collective.rank, dist.group.WORLD
    results = []
    for case, splits in enumerate(CASES):
        x, up = _inputs(case, rank)
        ins = splits[rank]
        outs = [splits[src][rank] for src in range(WORLD)]
        leaf = x.clone().requires_grad_()
        out = all_to_all_autograd(leaf, outs, ins, group)
        (out * up).sum().backward()
        # the helper agrees the splits itself; a round trip with the splits swapped is the identity
        leaf2 = x.clone().requires_grad_()
        got, agreed = all_to_all_uneven_autograd(leaf2, torch.tensor(ins), group)
        back = all_to_all_autograd(got, ins, agreed, group)
        back.sum().backward()
        results.append({"out": out.detach().numpy(), "grad": leaf.grad.numpy(), "agreed": agreed,
                        "splits_seen": exchange_splits(ins, group), "round_trip": back.detach().numpy(),
                        "x": x.numpy(), "ones": leaf2.grad.numpy()})
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[list[dict[str, Any]]]:
    return shared_ranks.run(_ranks)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_and_backward_match_one_process(per_rank, case):
    ref_out, ref_grad = _reference(case)
    for rank in range(WORLD):
        got = per_rank[rank][case]
        torch.testing.assert_close(torch.from_numpy(got["out"]), ref_out[rank], rtol=0, atol=TOL)
        torch.testing.assert_close(torch.from_numpy(got["grad"]), ref_grad[rank], rtol=0, atol=TOL)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_split_exchange_and_round_trip(per_rank, case):
    splits = CASES[case]
    for rank in range(WORLD):
        got = per_rank[rank][case]
        assert got["agreed"] == got["splits_seen"] == [splits[src][rank] for src in range(WORLD)]
        torch.testing.assert_close(torch.from_numpy(got["round_trip"]), torch.from_numpy(got["x"]), rtol=0, atol=0)
        assert (got["ones"] == 1).all()  # d(sum of the round trip)/dx = 1 for every row sent


def test_single_process_is_the_identity_and_errors_are_one_line():
    x = torch.randn(4, 2, requires_grad=True)
    assert all_to_all_autograd(x, [4], [4]) is x
    out, splits = all_to_all_uneven_autograd(x, [4])
    assert out is x and splits == [4]
    for call, words in [(lambda: all_to_all_autograd(x, [4], [3]), "sum to 3 but the tensor has 4"),
                        (lambda: all_to_all_autograd(x, [2, 2], [2, 2]), "for a group of 1"),
                        (lambda: exchange_splits([1, 3]), "2 input splits for a group of 1")]:
        with pytest.raises(CollectiveError) as info:
            call()
        assert words in str(info.value) and "\n" not in str(info.value)
