"""The routed experts: SwiGLU MLPs stored as ``[E, ...]`` weights and run with one grouped matmul per weight
(the kernel registry's ``grouped_mm``), locally or split over the ``ep`` ranks."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from crosstrain import kernels
from crosstrain.errors import ConfigError
from crosstrain.parallel import all_to_all_autograd, local_tensor
from crosstrain.parallel.tp_autograd import copy_to_tp, reduce_from_tp
from crosstrain.plugins.moe.exchange import HEADER, agree


def _sharded(old: nn.Parameter, shard: torch.Tensor, mesh: Any, dim: int) -> nn.Parameter:
    """``shard`` as a DTensor parameter over ``mesh`` that keeps ``old``'s ``requires_grad``: a base frozen
    before the split (LoRA) must stay frozen, or each rank trains its experts where one process does not."""
    return nn.Parameter(DTensor.from_local(shard, mesh, [Shard(dim)], run_check=False),
                        requires_grad=old.requires_grad)


class GroupedExperts(nn.Module):
    """``experts`` SwiGLU MLPs: ``w1``/``w3`` ``[E, dim, hidden]`` (gate, up), ``w2`` ``[E, hidden, dim]``.

    ``forward(rows, counts)`` takes token copies grouped by expert (``counts[e]`` rows for expert ``e``, as
    ``moe_permute`` returns them) and returns their outputs in the same order. Implements
    :class:`crosstrain.parallel.ExpertParallel`: after :meth:`apply_expert_parallel` the weights are DTensors
    sharded on dim 0 over the ``ep`` mesh (so gathering them gives the full ``[E, ...]`` weights, and
    checkpoints reshard across ep sizes) and rows travel to the rank that holds their expert.
    """

    def __init__(self, experts: int, dim: int, hidden: int, *, layer: str = "moe", layer_id: int = 0,
                 timeout_s: float = 60.0) -> None:
        super().__init__()
        self.num_experts = experts
        self.layer = layer
        self.layer_id = layer_id
        self.timeout_s = timeout_s
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.ep_group: Any = None
        self.ep_rank = 0
        self.ep_size = 1
        self.tp_mesh: Any = None

    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        with torch.no_grad():
            for w, s in ((self.w1, std), (self.w3, std), (self.w2, out_std)):
                w.copy_(torch.randn(w.shape, generator=generator) * s)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size

    # -- parallelism ------------------------------------------------------------------------------------------
    def apply_expert_parallel(self, ep_mesh: Any) -> None:
        """Keep experts ``[r * E/ep, (r + 1) * E/ep)`` on ep rank ``r`` (as DTensor shards over ``ep_mesh``)."""
        size = ep_mesh.size()
        if self.num_experts % size:
            raise ConfigError(f"parallel.ep={size} must divide moe.experts={self.num_experts}; pick a divisor")
        if self.tp_mesh is not None:
            raise ConfigError("moe layers with parallel.ep > 1 and parallel.tp > 1 together are not supported yet; "
                              "set parallel.tp=1 or parallel.ep=1")
        rank = ep_mesh.get_local_rank()
        n = self.num_experts // size
        for name in ("w1", "w3", "w2"):
            w = getattr(self, name)
            shard = w.detach()[rank * n:(rank + 1) * n].clone()
            setattr(self, name, _sharded(w, shard, ep_mesh, 0))
        self.ep_group, self.ep_rank, self.ep_size = ep_mesh.get_group(), rank, size

    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        """Megatron-style expert TP: ``w1``/``w3`` column-sharded, ``w2`` row-sharded; outputs all-reduced."""
        hidden, size = self.w1.shape[-1], tp_mesh.size()
        if hidden % size:
            raise ConfigError(f"parallel.tp={size} must divide the expert hidden size {hidden}; set moe.expert_dim "
                              "to a multiple of it")
        rank, n = tp_mesh.get_local_rank(), hidden // size
        for name, dim in (("w1", 2), ("w3", 2), ("w2", 1)):
            w = getattr(self, name)
            shard = w.detach().narrow(dim, rank * n, n).clone()
            setattr(self, name, _sharded(w, shard, tp_mesh, dim))
        self.tp_mesh = tp_mesh

    # -- compute ----------------------------------------------------------------------------------------------
    def _mlp(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = (local_tensor(w).to(rows.dtype) for w in (self.w1, self.w3, self.w2))
        if self.tp_mesh is not None:
            rows = copy_to_tp(rows, self.tp_mesh.get_group())
        # gate and up in one grouped matmul (fewer, larger GEMMs); the concatenation of the weights is cheap
        gate, up = kernels.grouped_mm(rows, torch.cat([w1, w3], dim=2), counts).chunk(2, dim=-1)
        out = kernels.grouped_mm(kernels.swiglu(gate, up), w2, counts)
        if self.tp_mesh is not None:  # each tp rank holds hidden / tp columns: its output is a partial sum
            out = reduce_from_tp(out, self.tp_mesh.get_group())
        return out

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, capacity: int = -1) -> torch.Tensor:
        """Outputs for ``rows`` grouped by expert (``counts [E]``); ``capacity`` (-1 = dropless) is checked to
        agree across ep ranks before the exchange."""
        if self.ep_group is None:
            return self._mlp(rows, counts)
        table = agree(self.layer, self.layer_id, counts, capacity, self.ep_group, self.timeout_s)
        per_rank = table[:, HEADER:]  # [ep, E]: rows rank j sends to expert e
        n, r = self.local_experts, self.ep_rank
        send = per_rank[r].view(self.ep_size, n).sum(dim=1).tolist()
        mine = per_rank[:, r * n:(r + 1) * n]  # [ep, n]: rows from rank j for my local expert e
        recv = mine.sum(dim=1).tolist()
        received = all_to_all_autograd(rows, recv, send, self.ep_group)
        # received rows are ordered (source rank, local expert): regroup them by local expert for grouped_mm
        local_ids = torch.repeat_interleave(torch.arange(n).repeat(self.ep_size), mine.reshape(-1))
        grouped, order, local_counts = kernels.moe_permute(received, local_ids.to(rows.device)[:, None], n)
        out = self._mlp(grouped, local_counts)
        out = kernels.moe_unpermute(out, order, out.new_ones(out.shape[0], 1))
        return all_to_all_autograd(out, send, recv, self.ep_group)


def expert_hidden(dense_hidden: int, top_k: int, shared: int, override: int = 0) -> int:
    """One expert's hidden size: ``override``, else the dense hidden size split over the ``top_k + shared``
    experts a token uses (equal active parameters), rounded up to a multiple of 8."""
    if override:
        return override
    return 8 * math.ceil(dense_hidden / (top_k + shared) / 8)
