"""``crosstrain.collective.global_sums``: the sum over ranks of each value (float64), divided by how many ranks hold
the same data. Used by the RL and SFT token counts (plugins/rlhf) and the detector's foreground count
(plugins/vision/detect)."""

from __future__ import annotations

from typing import Any

import torch

from crosstrain.collective import global_sums


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
