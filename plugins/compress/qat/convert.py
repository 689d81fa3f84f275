"""Post-training conversion of a fake-quantised model: integer weights and scales from each
:class:`~.linear.FakeQuantLinear`, and the same model computing with ``q * s`` (bit-identical to fake quantisation).
Applied to a model trained without QAT, the same steps are post-training quantization (PTQ) of the scheme."""

from __future__ import annotations

import copy

import torch
from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.plugins.compress.qat.fake_quant import dequantize_weight, quantize_weight
from crosstrain.plugins.compress.qat.linear import fake_quant_layers, quantize_linears
from crosstrain.plugins.compress.qat.onnx_weights import IntWeight
from crosstrain.plugins.compress.qat.schemes import Scheme


def fake_quantised(model: nn.Module, scheme: Scheme, what: str = "the model") -> nn.Module:
    """``model`` with fake quantisation under ``scheme``: as trained (a QAT run, whose layers already carry it; a
    different scheme is refused) or added now (PTQ of a model trained in floating point). In place."""
    layers = fake_quant_layers(model)
    if not layers:
        quantize_linears(model, scheme, what)
        return model
    trained = layers[0].qat_scheme
    if trained != scheme:
        raise ConfigError(f"{what} was trained with quant.qat={trained.name!r} (group {trained.group_size}); "
                          f"export it with that scheme, not {scheme.name!r} (group {scheme.group_size})")
    return model


def integer_model(model: nn.Module) -> tuple[nn.Module, list[IntWeight]]:
    """A copy of the fake-quantised ``model`` whose layers hold ``q * s`` (no weight rounding left in the forward),
    and each layer's integer weight."""
    converted = copy.deepcopy(model)
    names = {id(m): n for n, m in converted.named_modules()}
    weights = []
    with torch.no_grad():
        for m in fake_quant_layers(converted):
            s = m.qat_scheme
            q, scale = quantize_weight(m.weight, s.weight_bits, s.weight_group(m.in_features))
            dq = dequantize_weight(q, scale).to(m.weight.dtype)
            m.weight.copy_(dq)
            m.qat_weight_ready = True
            weights.append(IntWeight(names[id(m)], q, scale, s.weight_bits, dq))
    return converted, weights


def quantized_bytes(weights: list[IntWeight]) -> int:
    """Bytes of the integer weights packed at their bit width, plus their fp32 scales."""
    return sum((w.q.numel() * w.bits + 7) // 8 + 4 * w.scale.numel() for w in weights)
