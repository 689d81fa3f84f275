"""Integer weights in an exported ONNX graph: every float initializer holding a converted layer's dequantised weight
(either orientation: the exporter may fold ``W^T``) becomes an integer initializer, its scales and a
``DequantizeLinear`` (opset 21: int4 blocks along the input axis; int8 per output channel)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from crosstrain.plugins.export.errors import ExportError


@dataclass
class IntWeight:
    """One layer's integer weight ``q [out, in]`` (values of ``bits`` bits in int8 storage), scales
    ``[out, in / group]`` and ``q * s`` as the graph holds it."""

    name: str
    q: torch.Tensor
    scale: torch.Tensor
    bits: int
    dequantized: torch.Tensor


def _key(arr: np.ndarray) -> str:
    return hashlib.sha256(str(arr.shape).encode() + np.ascontiguousarray(arr, dtype=np.float32).tobytes()).hexdigest()


def pack_int4(q: np.ndarray) -> bytes:
    """ONNX INT4 raw data: two's-complement nibbles, element ``2i`` in the low half of byte ``i``."""
    flat = (q.reshape(-1).astype(np.int8) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()


def _int_tensor(name: str, q: np.ndarray, bits: int) -> object:
    from onnx import TensorProto, helper, numpy_helper

    if bits == 4:
        return helper.make_tensor(name, TensorProto.INT4, list(q.shape), vals=pack_int4(q), raw=True)
    return numpy_helper.from_array(q.astype(np.int8), name)


def integer_weights(model: object, weights: list[IntWeight]) -> int:
    """Replace, in the ``onnx.ModelProto`` ``model``, each initializer equal to a weight of ``weights`` (or its
    transpose) by integer storage + ``DequantizeLinear``; returns how many were replaced. Raises when a weight
    was not found (the graph would silently keep it in fp32)."""
    from onnx import helper, numpy_helper

    index: dict[str, tuple[IntWeight, bool]] = {}
    for w in weights:
        dq = w.dequantized.detach().float().numpy()
        index[_key(dq)] = (w, False)
        index[_key(dq.T)] = (w, True)
    graph = model.graph  # type: ignore[attr-defined]
    found: set[str] = set()
    nodes, keep = [], []
    for init in graph.initializer:
        hit = None
        if init.data_type == 1 and len(init.dims) == 2:
            hit = index.get(_key(numpy_helper.to_array(init)))
        if hit is None:
            keep.append(init)
            continue
        w, transposed = hit
        q, s = w.q.numpy(), w.scale.float().numpy()
        if transposed:
            q, s = q.T, s.T
        group = w.q.shape[1] // w.scale.shape[1]
        per_channel = w.bits == 8 and w.scale.shape[1] == 1  # int8: one scale per output channel (per-axis)
        axis = (1 if transposed else 0) if per_channel else (0 if transposed else 1)
        attrs = {"axis": axis} if per_channel else {"axis": axis, "block_size": group}
        s = s.reshape(-1) if per_channel else s
        keep += [_int_tensor(f"{init.name}.q", q, w.bits), numpy_helper.from_array(np.ascontiguousarray(s),
                                                                                     f"{init.name}.scale")]
        nodes.append(helper.make_node("DequantizeLinear", [f"{init.name}.q", f"{init.name}.scale"], [init.name],
                                      name=f"{init.name}.dequantize", **attrs))
        found.add(w.name)
    missing = [w.name for w in weights if w.name not in found]
    if missing:
        raise ExportError(f"the quantised weight of {missing[0]} was not found in the ONNX graph ({len(missing)} "
                          "layers), so the export would keep it in fp32; nothing was written")
    del graph.initializer[:]
    graph.initializer.extend(keep)
    for node in reversed(nodes):
        graph.node.insert(0, node)
    return len(nodes)
