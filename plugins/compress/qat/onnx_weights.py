"""Integer compute in an exported ONNX graph: every ``MatMul`` whose weight is a converted layer's dequantised weight
(the exporter folds ``W^T`` into an initializer) becomes onnxruntime's integer matmul on the integer weight, and the
token embedding (with a tied output head) is stored in int8.

* int8 weights (one scale per output channel): ``DynamicQuantizeLinear`` of the activation (one per distinct input,
  so ``wq``/``wk``/``wv`` share it) + ``MatMulInteger`` + the fp32 rescale, which onnxruntime fuses into
  ``DynamicQuantizeMatMul`` (u8 x s8 integer GEMM).
* int4 weights (one scale per ``group`` inputs): ``com.microsoft.MatMulNBits``, ``accuracy_level=4`` (activations
  in int8 per block, int8 dot products).
* the embedding: uint8 ``q + 128`` with one scale per row, ``Gather`` + rescale; a tied head reads the same bytes
  through ``MatMulNBits`` with ``bits=8`` (its ``[N, K]`` layout is the table's), scales repeated per block.

What each node computes is written out in PyTorch in :mod:`crosstrain.plugins.export.int_reference`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from crosstrain.plugins.export.errors import ExportError

MS_DOMAIN = "com.microsoft"
#: Integer ops the rewritten graph computes with (tests and the benchmark look for them).
INTEGER_OPS = ("DynamicQuantizeLinear", "MatMulInteger", "MatMulNBits")


@dataclass
class IntWeight:
    """One layer's integer weight ``q [out, in]`` (values of ``bits`` bits in int8 storage), scales
    ``[out, in / group]`` and ``q * s`` as the traced graph holds it."""

    name: str
    q: torch.Tensor
    scale: torch.Tensor
    bits: int
    dequantized: torch.Tensor


@dataclass
class IntEmbedding:
    """The token embedding in int8: ``q [vocab, dim]``, one scale per row ``[vocab, 1]``, ``q * s`` as traced;
    ``head_block`` > 0 when a tied output head computes with it (``MatMulNBits`` block size)."""

    q: torch.Tensor
    scale: torch.Tensor
    dequantized: torch.Tensor
    head_block: int = 0


def _key(arr: np.ndarray) -> str:
    return hashlib.sha256(str(arr.shape).encode() + np.ascontiguousarray(arr, dtype=np.float32).tobytes()).hexdigest()


def pack_uint(q: np.ndarray, bits: int, block: int) -> np.ndarray:
    """``MatMulNBits``' B: signed ``q [N, K]`` as unsigned ``q + 2^(bits-1)`` (its default zero point) in blocks
    ``[N, K / block, block * bits / 8]``; 4-bit element ``2i`` in the low nibble of byte ``i``."""
    u = (q.astype(np.int16) + 2 ** (bits - 1)).astype(np.uint8).reshape(q.shape[0], -1, block)
    return u if bits == 8 else (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8)


def nbits_block(group: int) -> bool:
    """``MatMulNBits`` takes blocks of a power of two >= 16."""
    return group >= 16 and group & (group - 1) == 0


class _Rewriter:
    """Collects the new nodes and initializers; ``dq_cache`` maps an activation to its DynamicQuantizeLinear."""

    def __init__(self) -> None:
        self.inits: list[Any] = []
        self.dq_cache: dict[str, tuple[str, str, str]] = {}

    def init(self, arr: np.ndarray, name: str) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def matmul_integer(self, x: str, w: IntWeight, out: str) -> list[Any]:
        from onnx import TensorProto, helper

        nodes = []
        if x not in self.dq_cache:
            self.dq_cache[x] = (f"{x}.q", f"{x}.scale", f"{x}.zero")
            nodes.append(helper.make_node("DynamicQuantizeLinear", [x], list(self.dq_cache[x]), name=f"{x}.dql"))
        xq, xs, xz = self.dq_cache[x]
        q = self.init(w.q.numpy().T.astype(np.int8), f"{w.name}.q")
        s = self.init(w.scale.float().numpy().reshape(-1), f"{w.name}.scale")
        return nodes + [
            helper.make_node("MatMulInteger", [xq, q, xz], [f"{out}.int"], name=f"{w.name}.matmul_integer"),
            helper.make_node("Cast", [f"{out}.int"], [f"{out}.float"], to=TensorProto.FLOAT, name=f"{w.name}.cast"),
            helper.make_node("Mul", [xs, s], [f"{out}.rescale"], name=f"{w.name}.rescale"),
            helper.make_node("Mul", [f"{out}.float", f"{out}.rescale"], [out], name=f"{w.name}.scale_out")]

    def matmul_nbits(self, x: str, q: str, scale: str, shape: tuple[int, int], bits: int, block: int, out: str,
                     name: str) -> Any:
        from onnx import helper

        n, k = shape
        return helper.make_node("MatMulNBits", [x, q, scale], [out], name=f"{name}.matmul_nbits", domain=MS_DOMAIN,
                                K=k, N=n, bits=bits, block_size=block, accuracy_level=4)

    def linear(self, x: str, w: IntWeight, out: str) -> list[Any]:
        group = w.q.shape[1] // w.scale.shape[1]
        if w.bits == 8 and w.scale.shape[1] == 1:
            return self.matmul_integer(x, w, out)
        q = self.init(pack_uint(w.q.numpy(), w.bits, group), f"{w.name}.q")
        s = self.init(w.scale.float().numpy().reshape(-1), f"{w.name}.scale")
        return [self.matmul_nbits(x, q, s, (w.q.shape[0], w.q.shape[1]), w.bits, group, out, w.name)]

    def embedding(self, emb: IntEmbedding, table: str, ids: str, out: str) -> list[Any]:
        from onnx import TensorProto, helper

        vocab, dim = emb.q.shape
        block = emb.head_block or dim
        self.init(pack_uint(emb.q.numpy(), 8, block), table)
        self.init(emb.scale.float().numpy().reshape(vocab, 1), f"{table}.row_scale")
        self.init(np.array([0, 0, dim], dtype=np.int64), f"{table}.shape")
        self.init(np.array(128.0, dtype=np.float32), f"{table}.zero")
        return [helper.make_node("Gather", [table, ids], [f"{out}.u8"], name=f"{table}.gather"),
                helper.make_node("Reshape", [f"{out}.u8", f"{table}.shape"], [f"{out}.rows"], name=f"{table}.rows"),
                helper.make_node("Cast", [f"{out}.rows"], [f"{out}.f"], to=TensorProto.FLOAT, name=f"{table}.cast"),
                helper.make_node("Sub", [f"{out}.f", f"{table}.zero"], [f"{out}.q"], name=f"{table}.center"),
                helper.make_node("Gather", [f"{table}.row_scale", ids], [f"{out}.s"], name=f"{table}.gather_scale"),
                helper.make_node("Mul", [f"{out}.q", f"{out}.s"], [out], name=f"{table}.rescale")]

    def tied_head(self, emb: IntEmbedding, table: str, x: str, out: str) -> Any:
        vocab, dim = emb.q.shape
        blocks = dim // emb.head_block
        s = self.init(np.repeat(emb.scale.float().numpy().reshape(vocab, 1), blocks, 1).reshape(-1),
                      f"{table}.head_scale")
        return self.matmul_nbits(x, table, s, (vocab, dim), 8, emb.head_block, out, "output")


def integer_graph(model: Any, weights: list[IntWeight], embedding: IntEmbedding | None = None) -> int:
    """Rewrite the ``onnx.ModelProto`` ``model`` in place (see the module docstring); returns how many matmuls now
    compute in integers. Raises when a weight was not found (the graph would silently keep it in fp32)."""
    from onnx import helper, numpy_helper

    graph = model.graph
    by_key: dict[str, IntWeight] = {}
    for w in weights:
        by_key[_key(w.dequantized.detach().float().numpy().T)] = w
    inits = {i.name: i for i in graph.initializer}
    table = None
    if embedding is not None:
        want = _key(embedding.dequantized.detach().float().numpy())
        table = next((n for n, i in inits.items() if i.data_type == 1 and len(i.dims) == 2
                      and _key(numpy_helper.to_array(i)) == want), None)
    transposed = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Transpose" and n.input[0] == table}
    rw, nodes, found, dropped = _Rewriter(), [], set(), set()
    matmuls = 0
    for node in graph.node:
        b = node.input[1] if node.op_type in ("MatMul", "Gather") else ""
        hit = by_key.get(_key(numpy_helper.to_array(inits[b]))) if node.op_type == "MatMul" and b in inits else None
        if hit is not None:
            nodes += rw.linear(node.input[0], hit, node.output[0])
            found.add(hit.name)
            dropped.add(b)
            matmuls += 1
        elif embedding is not None and node.op_type == "Gather" and node.input[0] == table:
            nodes += rw.embedding(embedding, f"{table}.u8", node.input[1], node.output[0])
            found.add("embedding")
        elif embedding is not None and embedding.head_block and node.op_type == "MatMul" and b in transposed:
            nodes.append(rw.tied_head(embedding, f"{table}.u8", node.input[0], node.output[0]))
            found.add("head")
            matmuls += 1
        elif not (node.op_type == "Transpose" and node.output[0] in transposed):
            nodes.append(node)
    wanted = [w.name for w in weights] + (["embedding"] if embedding is not None else []) + \
        (["head"] if embedding is not None and embedding.head_block else [])
    missing = [n for n in wanted if n not in found]
    if missing:
        raise ExportError(f"the quantised weight of {missing[0]} was not found in the ONNX graph ({len(missing)} "
                          "layers), so the export would keep it in fp32; nothing was written")
    if table is not None:
        dropped.add(table)
    keep = [i for i in graph.initializer if i.name not in dropped] + rw.inits
    del graph.initializer[:]
    graph.initializer.extend(keep)
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return matmuls
