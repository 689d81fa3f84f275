"""Tensor parallelism for the GPT through DTensor ``parallelize_module`` plans (Megatron-style).

Attention q/k/v and the SwiGLU gate/up projections are column-parallel (each rank owns ``n_heads / tp`` heads
and ``hidden / tp`` ffn columns; attention infers the local head count from the projection width), the output
projections ``wo``/``w2`` are row-parallel (their outputs are all-reduced). The token embedding is sharded
over the vocabulary (row-parallel, all-reduced output), the LM head over the vocabulary (column-parallel,
all-gathered logits). Norm weights stay replicated plain parameters: their inputs and gradients are identical
on every tp rank.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def block_plan() -> dict[str, Any]:
    """The per-block plan (keys relative to a ``Block``)."""
    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    """Shard ``model`` (a GPT or one pipeline stage of it) over ``tp_mesh`` in place."""
    top: dict[str, Any] = {}
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=True)
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    tied = bool(getattr(getattr(model, "config", None), "tie_embeddings", False))
    if top:
        parallelize_module(model, tp_mesh, top)
    output, embeddings = getattr(model, "output", None), getattr(model, "tok_embeddings", None)
    if tied and output is not None and embeddings is not None:
        # Both shard the [vocab, dim] weight on dim 0, so the tie survives as one DTensor.
        output.weight = embeddings.weight
    for block in cast(nn.ModuleDict, model.layers).values():
        parallelize_module(block, tp_mesh, block_plan())
