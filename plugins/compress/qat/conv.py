"""Static int8 fake quantisation of a conv net: every ``nn.Conv2d`` and ``nn.Linear`` of a model that has a
convolution, in place, with PyTorch's own eager-mode QAT fake quantisers (``torch.ao.quantization``).

torchao 0.18's QAT (``QATConfig``/``IntxFakeQuantizeConfig``) swaps ``nn.Linear`` and ``nn.Embedding`` only, and
its per-token dynamic activations have no static integer form onnxruntime runs in a conv net; torch.ao's QAT for
conv is the one a PyTorch user knows (``torch.ao.nn.qat.Conv2d`` + ``get_default_qat_qconfig``):

- weights: :data:`WEIGHT_FAKE_QUANT`, ``FakeQuantize`` with torch.ao's moving-average per-channel observer: symmetric
  int8 per output channel, zero point 0, integers in [-127, 127] (onnxruntime's range for symmetric int8 weights),
  scale ``max(|min_c|, |max_c|) / 127`` from a moving average (0.01) of the channel's min/max. Not the fused
  ``fused_per_channel_wt_fake_quant_range_neg_127_to_127`` of torch's default QAT qconfig: its C++ qparams give a
  channel whose weights are all of one sign a zero point of -127 (measured after 100 steps on the digits), which
  onnxruntime's int8 ``QLinearConv`` cannot take;
- activations: :class:`GlobalRangeActFakeQuant`, torch.ao's ``default_fused_act_fake_quant`` (the same fused op and
  arguments): per-tensor asymmetric uint8 [0, 255] (onnxruntime's U8S8, the fast x86 form), ranges from a moving
  average of the observed min/max -- under data parallelism the min/max of the whole data-parallel batch, so N ranks
  keep the ranges one process keeps.

Quantised where onnxruntime's static QDQ quantizer quantises (it turns ``DQ -> Conv -> Q`` into ``QLinearConv``):
a layer's input, its weight, and a convolution's output; a linear layer's output stays float (the logits, the
export's ``OpTypesToExcludeOutputQuantization``). Ranges are observed on training batches only: ``.eval()`` freezes
them (torch.ao leaves that to a ``disable_observer`` call). The swap keeps the parameter names; the quantisers'
buffers (scales, zero points, observed ranges) join the state dict and the checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization.fake_quantize import FakeQuantize, FakeQuantizeBase, FusedMovingAvgObsFakeQuantize
from torch.ao.quantization.observer import MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver

from crosstrain.collective import all_reduce_served
from crosstrain.errors import ConfigError
from crosstrain.plugins.compress.qat.schemes import Scheme

#: the weights' fake quantiser (the module docstring says why not the fused one)
WEIGHT_FAKE_QUANT = FakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-127,
                                           quant_max=127, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                           eps=2**-12)


class _Shared:
    """A reference that ``copy.deepcopy`` shares instead of copying (a ``ProcessGroup`` cannot be copied)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self


class GlobalRangeActFakeQuant(FusedMovingAvgObsFakeQuantize):
    """torch.ao's fused activation fake quantiser whose moving-average observer sees the data-parallel batch's range.

    Without a group (one process, or before :meth:`apply_data_parallel`) ``forward`` is torch.ao's, unchanged. With
    one, each observing forward all-reduces this rank's ``(-min, max)`` (one MAX: the min of the ranks' minima is
    the global minimum), then runs torch.ao's own fused op twice: observing only, on the two-element tensor
    ``[global min, global max]`` (whose ``aminmax`` is what one process's would be on the whole batch, so the
    moving average takes the same step), then fake-quantising ``x`` with the observer off (the op derives the scale
    and zero point from the running min/max, as the single observing call does; ``fused_obs_fake_quant.cpp``).
    """

    _dp: _Shared | None = None

    @property
    def dp_group(self) -> Any:
        """The data-parallel process group whose batch the observer sees; None: this process's batch only."""
        return None if self._dp is None else self._dp.value

    def apply_data_parallel(self, group: Any) -> None:
        """Observe the batch of every rank in ``group`` (the protocol of :mod:`crosstrain.parallel.batch_stats`)."""
        self._dp = _Shared(group)

    def _fused(self, x: torch.Tensor, observe: torch.Tensor, fake_quant: torch.Tensor) -> torch.Tensor:
        obs = self.activation_post_process
        return torch.fused_moving_avg_obs_fake_quant(x, observe, fake_quant, obs.min_val, obs.max_val, self.scale,
                                                     self.zero_point, obs.averaging_constant, obs.quant_min,
                                                     obs.quant_max, self.ch_axis, self.is_per_channel,
                                                     self.is_symmetric_quant)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if self.dp_group is None or not int(self.observer_enabled[0]):
            return super().forward(X)
        lo, hi = torch.aminmax(X.detach())
        ends = torch.stack([-lo, hi]).float()
        ends = all_reduce_served(ends, dist.ReduceOp.MAX, self.dp_group).to(X.dtype)
        off = torch.zeros_like(self.observer_enabled)
        with torch.no_grad():
            self._fused(torch.stack([-ends[0], ends[1]]), self.observer_enabled, off)
        return self._fused(X, off, self.fake_quant_enabled)


#: the activations' fake quantiser: torch.ao's ``default_fused_act_fake_quant`` (same arguments), global ranges
ACT_FAKE_QUANT = GlobalRangeActFakeQuant.with_args(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                                   dtype=torch.quint8)
#: the scheme the conv path implements (int4 weights would need onnxruntime's MatMulNBits, which has no conv)
CONV_SCHEMES = ("int8",)


class _StaticFakeQuant:
    """What a statically fake-quantised layer adds to its class: the quantisers and the train/eval switch."""

    qat_enabled: bool
    input_fake_quant: FakeQuantizeBase
    weight_fake_quant: FakeQuantizeBase

    def quantisers(self) -> list[FakeQuantizeBase]:
        return [m for m in self.children() if isinstance(m, FakeQuantizeBase)]  # type: ignore[attr-defined]

    def train(self, mode: bool = True) -> Any:
        """``nn.Module.train``, and the quantisers observe ranges in training mode only."""
        super().train(mode)  # type: ignore[misc]
        for fq in self.quantisers():
            fq.enable_observer(mode)
        return self


class FakeQuantConv2d(_StaticFakeQuant, nn.Conv2d):
    """``conv(fq_in(x), fq_w(w)) + b``, then ``fq_out``: onnxruntime's ``QLinearConv`` in floating point."""

    output_fake_quant: FakeQuantizeBase

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.qat_enabled:
            return super().forward(x)
        y = self._conv_forward(self.input_fake_quant(x), self.weight_fake_quant(self.weight), self.bias)
        return self.output_fake_quant(y)


class FakeQuantStaticLinear(_StaticFakeQuant, nn.Linear):
    """``linear(fq_in(x), fq_w(w), b)`` with a float output: onnxruntime's ``QGemm`` with a float ``Y``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.qat_enabled:
            return super().forward(x)
        return F.linear(self.input_fake_quant(x), self.weight_fake_quant(self.weight), self.bias)


def has_conv(model: nn.Module) -> bool:
    """Whether ``model`` is a conv net (the static path applies), not a language model."""
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def check_conv_scheme(name: str, what: str) -> None:
    """A one-line error when ``quant.qat = name`` has no conv form."""
    if name not in CONV_SCHEMES:
        raise ConfigError(f"quant.qat={name!r} is for a language model's linear layers; {what} is a conv net, "
                          "which trains with quant.qat=\"int8\" (per-channel int8 weights, per-tensor int8 "
                          "activations)")


def check_convnet(model: nn.Module, scheme: Scheme, what: str) -> None:
    """One-line errors for a conv net this path cannot fake-quantise as onnxruntime would run it."""
    check_conv_scheme(scheme.name, what)
    bn = next((n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)), None)
    if bn is not None:
        raise ConfigError(f"quant.qat=\"int8\" on a conv net with BatchNorm ({what}: {bn!r}) is not supported: the "
                          "integer export folds BatchNorm into the conv, which QAT would have to train (torch.ao's "
                          "fuse_modules_qat); use a GroupNorm model such as classify.model=\"digits_cnn\"")


def quantize_convnet(model: nn.Module, scheme: Scheme, what: str = "the model") -> list[str]:
    """Turn every plain ``nn.Conv2d`` and ``nn.Linear`` of ``model`` into its fake-quantised class (in place);
    returns their names. Checks the model before changing anything."""
    check_convnet(model, scheme, what)
    layers = {n: m for n, m in model.named_modules() if type(m) in (nn.Conv2d, nn.Linear)}
    for m in layers.values():
        conv = isinstance(m, nn.Conv2d)
        m.__class__ = FakeQuantConv2d if conv else FakeQuantStaticLinear
        device = m.weight.device
        m.add_module("input_fake_quant", ACT_FAKE_QUANT().to(device))
        m.add_module("weight_fake_quant", WEIGHT_FAKE_QUANT().to(device))
        if conv:
            m.add_module("output_fake_quant", ACT_FAKE_QUANT().to(device))
        m.qat_enabled = True  # type: ignore[assignment]
        m.train(m.training)  # type: ignore[operator]
    return list(layers)


def static_layers(model: nn.Module) -> dict[str, _StaticFakeQuant]:
    """The statically fake-quantised layers of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, _StaticFakeQuant)}  # type: ignore[misc]
