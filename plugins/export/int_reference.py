"""What onnxruntime computes for the integer ops of a quantised export, written in PyTorch: the reference the
parity gate compares the exported graph with, and the layers of that reference model.

* ``DynamicQuantizeLinear`` (ONNX spec; onnxruntime's ``GetQuantizationParameter`` + ``MlasQuantizeLinear``):
  one uint8 grid per tensor, ``lo = min(min x, 0)``, ``hi = max(max x, 0)``, ``s = (hi - lo) / 255`` (1 when
  ``hi == lo``), ``z = rne(clamp(-lo / s, 0, 255))``, ``q = clamp(rne(x / s) + z, 0, 255)`` (rne: round half to
  even). ``MatMulInteger`` then sums ``(q - z) * w_q`` exactly in int32; the graph scales by ``s * s_w`` in fp32.
* ``MatMulNBits`` at ``accuracy_level=4`` (MLAS ``CompInt8``): every row of A is quantised per block of
  ``block_size`` along K, symmetric int8, ``s = max|a| / 127``, ``q = rne(a * (127 / max|a|))``; each block's integer
  dot product with the weight block ``q_w - zero_point`` is scaled by ``s * s_w`` and the blocks are summed in fp32.

``MatMulInteger``'s sums are exact here (float64), so that path is bit-identical to onnxruntime's; ``MatMulNBits``'
blocks are summed in fp32 in another order, which differs by fp32 rounding only (``int_parity.py`` bounds both).
"""

from __future__ import annotations

import torch
from torch import nn


def dynamic_quantize_linear(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ONNX ``DynamicQuantizeLinear`` of ``x``: uint8 values (as fp32), the fp32 scale and zero point (0-d)."""
    x = x.float()
    lo = torch.clamp(x.min(), max=0.0)
    hi = torch.clamp(x.max(), min=0.0)
    scale = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 255.0)
    zero = torch.round(torch.clamp(-lo / scale, 0.0, 255.0))
    return torch.clamp(torch.round(x / scale) + zero, 0.0, 255.0), scale, zero


def block_quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MLAS ``CompInt8`` quantisation of A: ``x [..., K]`` -> int8 values ``[..., K / block, block]`` (as fp32) and
    one scale per block ``[..., K / block]``."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = g.abs().amax(-1)
    inv = torch.where(amax != 0, 127.0 / torch.where(amax != 0, amax, 1.0), torch.zeros_like(amax))
    return torch.round(g * inv.unsqueeze(-1)), amax / 127.0


def matmul_integer(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``DynamicQuantizeLinear(x)`` x ``MatMulInteger`` with int8 weights ``wq [out, in]`` (zero point 0), scaled
    by ``s * w_scale [out]``: ``[..., in] -> [..., out]``."""
    q, s, z = dynamic_quantize_linear(x)
    acc = (q - z).double() @ wq.double().T  # exact: |acc| < in * 255 * 128 << 2^53
    return acc.float() * (s * w_scale.float())


def matmul_nbits(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, block: int) -> torch.Tensor:
    """``MatMulNBits`` (``accuracy_level=4``) with signed weights ``wq [out, in]`` (``q_w - zero_point``) and scales
    ``w_scale [out, in / block]``: ``[..., in] -> [..., out]``."""
    qa, sa = block_quantize_int8(x, block)
    a = (qa * sa.unsqueeze(-1)).reshape(x.shape)  # q_a * s_a: exact in fp32 (an 8-bit integer times a float)
    w = (wq.float().reshape(wq.shape[0], -1, block) * w_scale.float().unsqueeze(-1)).reshape(wq.shape)
    # summed as fp32 products (the kernel: exact int32 per block, then fp32 sums of scaled blocks): the two
    # orders differ by fp32 rounding only, ~sqrt(K) ulp of the output
    return a @ w.T


class OrtIntLinear(nn.Module):
    """A linear layer computing what its integer ONNX node computes: ``kind`` "matmul_integer" (int8 weights, one
    scale per output channel) or "matmul_nbits" (``bits``-bit weights, one scale per ``block`` inputs)."""

    wq: torch.Tensor
    scale: torch.Tensor

    def __init__(self, kind: str, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 block: int = 0) -> None:
        super().__init__()
        self.kind, self.block = kind, block
        self.out_features, self.in_features = wq.shape
        self.register_buffer("wq", wq.to(torch.int8))
        self.register_buffer("scale", scale.float())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "matmul_integer":
            y = matmul_integer(x, self.wq, self.scale.reshape(-1))
        else:
            y = matmul_nbits(x, self.wq, self.scale, self.block)
        return y if self.bias is None else y + self.bias
