"""The PyTorch side of an integer ONNX export: the int8 token embedding, and the reference model that computes what
the rewritten graph computes (:mod:`.int_reference`), which the parity gate holds the graph to."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from crosstrain.plugins.compress.qat.fake_quant import dequantize_weight, quantize_weight
from crosstrain.plugins.compress.qat.onnx_weights import IntEmbedding, IntWeight, nbits_block
from crosstrain.plugins.export.int_reference import OrtIntLinear

#: Block of the tied head's ``MatMulNBits`` (its activations are quantised per block of this many inputs).
HEAD_BLOCK = 32


def quantize_embedding(model: Any) -> IntEmbedding | None:
    """Store ``model``'s token embedding in int8 (symmetric, one scale per row; its weight now holds ``q * s``); a
    tied head computes with the same integers. None, and nothing changed, when a tied head's width has no
    ``MatMulNBits`` block (a power of two >= 16 dividing it)."""
    emb = model.tok_embeddings
    tied = model.output is not None and model.output.weight is emb.weight
    dim = emb.weight.shape[1]
    block = next((b for b in (HEAD_BLOCK, 16) if dim % b == 0 and nbits_block(b)), 0) if tied else 0
    if tied and not block:
        return None
    with torch.no_grad():
        q, s = quantize_weight(emb.weight, 8, dim)
        dq = dequantize_weight(q, s)
        emb.weight.copy_(dq)
    return IntEmbedding(q, s, dq, block)


def _swap(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def ort_reference(converted: nn.Module, weights: list[IntWeight], embedding: IntEmbedding | None) -> nn.Module:
    """A copy of ``converted`` (:func:`~crosstrain.plugins.compress.qat.convert.integer_model`'s model, its
    embedding from :func:`quantize_embedding`) whose quantised layers compute as onnxruntime's integer ops."""
    ref = copy.deepcopy(converted).eval()
    for w in weights:
        layer = ref.get_submodule(w.name)
        group = w.q.shape[1] // w.scale.shape[1]
        kind = "matmul_integer" if w.bits == 8 and w.scale.shape[1] == 1 else "matmul_nbits"
        _swap(ref, w.name, OrtIntLinear(kind, w.q, w.scale, layer.bias, group))  # type: ignore[arg-type]
    if embedding is not None and embedding.head_block:
        blocks = embedding.q.shape[1] // embedding.head_block
        _swap(ref, "output", OrtIntLinear("matmul_nbits", embedding.q, embedding.scale.repeat(1, blocks), None,
                                          embedding.head_block))
    return ref
