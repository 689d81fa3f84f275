"""Fake-quantised linear layers: every ``nn.Linear`` of a model becomes a :class:`FakeQuantLinear` in place.

A layer with a LoRA adapter (one defining ``adapter_output(x)`` and ``lora_enabled``) keeps it: its base path is
fake-quantised and the adapter's low-rank update, computed from the unquantised input, is added in floating point
(torchtune's QAT + LoRA recipe); merged and quantised on export.

The swap keeps the class's parameter names (``wq.weight``), so checkpoints, FSDP2 sharding plans and export keep
their layout; under FSDP2 the forward sees the all-gathered weight, so quantisation groups never straddle shards.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.plugins.compress.qat.fake_quant import fake_quant_per_token, fake_quant_weight
from crosstrain.plugins.compress.qat.schemes import Scheme

#: Layers left in floating point: an MoE router's logits pick experts, and a flipped choice costs more than int8
#: saves on a layer this small (the common practice of torchao's and NeMo's QAT recipes).
SKIPPED = ("router",)


class FakeQuantLinear(nn.Linear):
    """An ``nn.Linear`` whose input (per token) and weight (per channel or group) are fake-quantised;
    made from an existing Linear by :func:`quantize_linears`."""

    qat_scheme: Scheme
    qat_enabled: bool
    qat_weight_ready: bool  # the weight already holds dequantised integers (the export's converted model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.qat_enabled:
            return super().forward(x)  # nn.Linear's, or a LoRA layer's with its adapter
        if row_parallel(self.weight):
            out = _gathered(self._quantised_linear, x, self.weight, self.bias)
        else:
            out = self._quantised_linear(x, self.weight, self.bias)
        if getattr(self, "lora_enabled", False):  # a LoRA-adapted layer (see the module docstring)
            out = out + self.adapter_output(x)  # type: ignore[attr-defined]
        return out

    def _quantised_linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``linear(fq(x), fq(w), bias)``: torchao's fake-quantised linear, op for op."""
        s = self.qat_scheme
        if not self.qat_weight_ready:
            w = fake_quant_weight(w, s.weight_bits, s.weight_group(self.in_features))
        return F.linear(fake_quant_per_token(x, s.act_bits) if s.act_bits else x, w, bias)


def row_parallel(weight: torch.Tensor) -> bool:
    """A weight tensor parallelism shards along ``in_features`` (a DTensor with ``Shard(1)``: RowwiseParallel)."""
    placements = getattr(weight, "placements", ())
    return any(getattr(p, "dim", None) in (1, -1) for p in placements)


def _gathered(fn: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """``fn`` on the whole input and weight of a row-parallel layer, replicated on every tp rank.

    Split along ``in_features``, the layer's output is the all-reduced sum of per-rank partial products: the same
    value as one process's matmul up to fp32 summation order (1e-7). Without quantisation that is harmless; with
    it, the next layer's activation quantiser turns such a 1e-7 into a whole grid step wherever a value sits on a
    rounding boundary (measured: 2 flips in ``wo``'s input at step 1, the DPO loss 2.6e-5 apart). Gathering the
    input and the weight makes the product one process's, bit for bit, at the cost of computing this layer on
    every tp rank. The backward needs no collective: each rank keeps its shard of the replicated gradients."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = w.device_mesh  # type: ignore[attr-defined]
    whole = [Replicate()] * mesh.ndim

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.redistribute(mesh, whole).to_local() if isinstance(t, DTensor) else t

    out = fn(local(x), local(w), None if bias is None else local(bias))
    return DTensor.from_local(out, mesh, whole, run_check=False)


def quantizable(model: nn.Module) -> dict[str, nn.Linear]:
    """The layers :func:`quantize_linears` converts: plain ``nn.Linear`` s and LoRA-adapted ones, not a router,
    not one whose owner reads its weight without calling it (``forward_unused``), not sharing their weight with an
    embedding (a tied output head stays as trained)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {name: m for name, m in model.named_modules()
            if (type(m) is nn.Linear or _adapted(m)) and name.rsplit(".", 1)[-1] not in SKIPPED
            and id(m.weight) not in embedded and not getattr(m, "forward_unused", False)}


def _adapted(m: nn.Module) -> bool:
    """A LoRA-adapted linear layer (see the module docstring) not fake-quantised yet."""
    return isinstance(m, nn.Linear) and hasattr(m, "adapter_output") and not isinstance(m, FakeQuantLinear)


@functools.cache
def _fake_quant_class(cls: type[nn.Linear]) -> type[FakeQuantLinear]:
    """:class:`FakeQuantLinear` for a plain Linear; for a LoRA layer's class, one that is both (its forward first)."""
    return FakeQuantLinear if cls is nn.Linear else type(f"FakeQuant{cls.__name__}", (FakeQuantLinear, cls), {})


def check_layers(layers: dict[str, nn.Linear], scheme: Scheme, what: str) -> None:
    """One-line errors for a model QAT cannot convert."""
    if not layers:
        raise ConfigError(f"quant.qat={scheme.name!r}: {what} has no nn.Linear layer to fake-quantise; set "
                          "quant.qat=\"none\" for this model")
    for name, m in layers.items():
        group = scheme.weight_group(m.in_features)
        if m.in_features % group:
            raise ConfigError(f"quant.group_size={group} does not divide {name}.in_features={m.in_features} of "
                              f"{what}; set quant.group_size to a divisor of every linear layer's input size")


def quantize_linears(model: nn.Module, scheme: Scheme, what: str = "the model") -> list[str]:
    """Turn every :func:`quantizable` layer of ``model`` into a :class:`FakeQuantLinear` (in place); returns their
    names. Checks all layers before changing any."""
    layers = quantizable(model)
    check_layers(layers, scheme, what)
    for m in layers.values():
        m.__class__ = _fake_quant_class(type(m))
        m.qat_scheme = scheme  # type: ignore[attr-defined]
        m.qat_enabled = True  # type: ignore[attr-defined]
        m.qat_weight_ready = False  # type: ignore[attr-defined]
    return list(layers)


def fake_quant_layers(model: nn.Module) -> list[FakeQuantLinear]:
    """The :class:`FakeQuantLinear` s inside ``model`` (wrapped by FSDP/DDP or not)."""
    return [m for m in model.modules() if isinstance(m, FakeQuantLinear)]


@contextlib.contextmanager
def fake_quant_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` in floating point inside the block (its fp loss, next to the fake-quantised one); a conv net's
    static layers (:mod:`.conv`) too."""
    from crosstrain.plugins.compress.qat.conv import static_layers

    layers = [*fake_quant_layers(model), *static_layers(model).values()]
    for m in layers:
        m.qat_enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.qat_enabled = True
