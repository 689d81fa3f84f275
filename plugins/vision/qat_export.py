"""``crosstrain export <classify QAT run> --quantize``: the classifier trained with ``quant.qat = "int8"`` as an
integer ONNX model, computing what its fake-quantised PyTorch model computes, with the scales it learned.

onnxruntime writes the integers, with its own tools: the float classifier (weights = the fake quantisers' ``q * s``,
fake quantisation off) is traced as the fp32 export traces it, then ``quant_pre_process`` and ``quantize_static``
in QDQ format (U8S8, per-channel weights) as ``--int8`` does, except that every scale and zero point is the
trained one (``TensorQuantOverrides``: each Conv/Gemm input, each Conv output, each weight per channel) and a
linear layer's output stays float (``OpTypesToExcludeOutputQuantization``), as in training
(:mod:`crosstrain.plugins.compress.qat.conv`). onnxruntime fuses the result into ``QLinearConv`` and ``QGemm``.
A tensor onnxruntime quantises that training did not is an error, not a calibrated guess.

The gate, in two halves. First, what the file stores (:func:`check_stored`): every QuantizeLinear quantises a
tensor training quantised, with the trained scale and zero point, and each layer's int8 weights and per-channel
scales are its fake quantiser's, all compared exactly. Second, what it computes: the parity bound of the compress
plugin's integer export (:mod:`crosstrain.plugins.export.int_parity` derives it). Let ``R`` be the fake-quantised
model's logits, ``O`` onnxruntime's and ``F`` those of the same integer weights with float activations. Both
compute the same integers; they differ by fp32 summation order and by the rounding flips it causes where an
activation lies on a rounding boundary (onnxruntime sums integers exactly and rounds ``x / s``, torch sums in fp32
and rounds ``x * (1 / s)``), each side within half a step of ``F``: ``max|O - R| <= 1e-4 + 2 max|R - F|`` on
every batch (the run's held-out images in batches of 1, 7, 16 and 64, and a batch of noise). A bound, not top-1
agreement: an image whose top-2 logits lie within a rounding step may legitimately flip. The bound alone is loose
(measured on the digits CNN: a head weight scale 5% off fails it, an input scale 2x off does not), which is why
the stored integers and scales are compared exactly first. Top-1 agreement with ``R`` on the held-out batches is
reported.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from crosstrain.plugins.export.errors import ExportError, ParityError
from crosstrain.plugins.vision.load import ImageModel

#: the file's ``crosstrain.quantization`` metadata
QUANTIZATION = "int8-qat-qdq"


@dataclasses.dataclass
class QatParity:
    """onnxruntime vs the fake-quantised model: the worst error and its bound over ``batches`` batches."""

    max_abs_err: float
    bound: float  # the smallest per-batch bound
    worst_ratio: float  # max over batches of error / that batch's bound (<= 1 passes)
    batches: int
    images: int
    held_out_top1_agree: float  # share of the held-out images whose top-1 is the fake-quantised model's
    passed: bool
    fixed: bool = False  # ``bound`` is --quant-tolerance, not derived

    def describe(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        bound = (f"the fixed bound {self.bound:g}" if self.fixed else
                 f"each batch's bound 1e-4 + 2 max|R - F| (smallest {self.bound:.3g})")
        return (f"max abs logit error {self.max_abs_err:.3g} over {self.batches} batches ({self.images} images), "
                f"at most {self.worst_ratio:.3f} of {bound}; top-1 agreement {self.held_out_top1_agree:.4f} on the "
                f"held-out batches: {verdict}")


def _static(model: nn.Module) -> dict[str, Any]:
    from crosstrain.plugins.compress.qat.conv import static_layers

    return static_layers(model)


def float_twin(model: nn.Module) -> nn.Module:
    """A copy of the fake-quantised ``model`` holding ``q * s`` weights with fake quantisation off: what is traced."""
    twin = copy.deepcopy(model).eval()
    with torch.no_grad():
        for m in _static(twin).values():
            m.weight.copy_(m.weight_fake_quant(m.weight))
            m.qat_enabled = False
    return twin


def float_activations(model: nn.Module) -> nn.Module:
    """``F``: a copy of ``model`` with its weights fake-quantised and its activations not."""
    twin = copy.deepcopy(model).eval()
    for m in _static(twin).values():
        for fq in m.quantisers():
            if fq is not m.weight_fake_quant:
                fq.disable_fake_quant()
    return twin


def _act(fq: Any) -> dict[str, Any]:
    return {"scale": np.array(fq.scale.item(), np.float32), "zero_point": np.array(fq.zero_point.item(), np.uint8)}


def overrides(model: nn.Module, graph: Any) -> dict[str, list[dict[str, Any]]]:
    """``TensorQuantOverrides`` for ``graph`` (the prepared float ONNX of ``model``): each quantised layer's
    input (and a conv's output) and weight, found by the weight's initializer name (the parameter's name)."""
    layers = {f"{name}.weight": m for name, m in _static(model).items()}
    out: dict[str, list[dict[str, Any]]] = {}
    found = set()
    for node in graph.graph.node:
        if node.op_type not in ("Conv", "Gemm") or len(node.input) < 2 or node.input[1] not in layers:
            continue
        m = layers[node.input[1]]
        found.add(node.input[1])
        out[node.input[0]] = [_act(m.input_fake_quant)]
        if hasattr(m, "output_fake_quant"):
            out[node.output[0]] = [_act(m.output_fake_quant)]
        out[node.input[1]] = [{"axis": 0, "scale": np.array(s, np.float32), "zero_point": np.array(0, np.int8)}
                              for s in m.weight_fake_quant.scale.tolist()]
    missing = sorted(set(layers) - found)
    if missing:
        raise ExportError(f"{missing[0]!r} is not the weight of a Conv or Gemm node in the traced classifier, so its "
                          "trained scales cannot be given to onnxruntime; this model has no integer export yet")
    return out


def quantize_qat(model: ImageModel, src: Path, dst: Path) -> int:
    """Write ``dst``: ``src`` (the traced :func:`float_twin`) quantised by onnxruntime with the trained scales;
    returns the number of integer tensors :func:`check_stored` compared."""
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from crosstrain.plugins.export.quantize import carry_metadata, quantizer_errors
    from crosstrain.plugins.vision.quantize import _calibration_reader

    prepared = dst.with_name(dst.stem + ".pre.onnx")
    try:
        with quantizer_errors("int8 QAT export of the classifier"):
            quant_pre_process(str(src), str(prepared))
            graph = onnx.load(str(prepared))
            given = overrides(model.model, graph)
            # the reader only feeds the calibration pass onnxruntime runs anyway; every range it would set is given
            quantize_static(str(prepared), str(dst), _calibration_reader(model), quant_format=QuantFormat.QDQ,
                            per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            op_types_to_quantize=["Conv", "Gemm"],
                            extra_options={"TensorQuantOverrides": given,
                                           "OpTypesToExcludeOutputQuantization": ["Gemm"]})
    finally:
        prepared.unlink(missing_ok=True)
    weights = {n.name: n.input[1] for n in graph.graph.node if n.input[1:2] and n.input[1] in given}
    quantised = onnx.load(str(dst))
    checked = check_stored(quantised, given, weights, model.model)
    for node in quantised.graph.node:  # the exporter's per-node debug records (stack traces, source paths): 40 kB
        del node.metadata_props[:]
    onnx.save(quantised, str(dst))
    carry_metadata(src, dst, QUANTIZATION)
    return checked


def check_stored(graph: Any, given: dict[str, list[dict[str, Any]]], weights: dict[str, str],
                 model: nn.Module) -> int:
    """The first half of the gate: every QuantizeLinear of ``graph`` quantises a tensor training quantised, with
    its trained scale and zero point, and each layer's integer weights and per-channel scales are the fake
    quantiser's, exactly (``weights``: node name -> weight name). Returns the number of tensors compared."""
    from onnx import numpy_helper

    init = {i.name: numpy_helper.to_array(i) for i in graph.graph.initializer}
    made = {o: n for n in graph.graph.node for o in n.output}
    checked = 0
    for node in graph.graph.node:
        if node.op_type != "QuantizeLinear":
            continue
        want = given.get(node.input[0])
        if want is None:
            raise ParityError(f"onnxruntime quantised {node.input[0]!r}, which the QAT model keeps float; nothing "
                              "was written")
        if init[node.input[1]] != want[0]["scale"] or init[node.input[2]] != want[0]["zero_point"]:
            raise ParityError(f"the int8 file quantises {node.input[0]!r} with another scale or zero point than "
                              "training learned; nothing was written")
        checked += 1
    layers = _static(model)
    for node in graph.graph.node:
        if node.name not in weights:
            continue
        name = weights[node.name]
        dq = made.get(node.input[1])
        m = layers[name.removesuffix(".weight")]
        scale = m.weight_fake_quant.scale.detach()
        with torch.no_grad():
            q = torch.round(m.weight_fake_quant(m.weight) / scale.view(-1, *[1] * (m.weight.dim() - 1)))
        if (dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in init
                or not np.array_equal(init[dq.input[0]], q.to(torch.int8).numpy())
                or not np.array_equal(init[dq.input[1]], scale.numpy().astype(np.float32))):
            raise ParityError(f"the int8 file's {name} is not the fake quantiser's integers and scales; nothing was "
                              "written")
        checked += 1
    return checked


@torch.no_grad()
def check_qat_parity(model: ImageModel, path: Path, seed: int = 0, tolerance: float | None = None) -> QatParity:
    """Apply the module docstring's bound to ``path`` against ``model.model`` (fake-quantised, eval); ``tolerance``:
    a fixed bound instead (``--quant-tolerance``)."""
    from crosstrain.plugins.export.defaults import DEFAULT_TOLERANCE
    from crosstrain.plugins.export.runtime import make_session, run
    from crosstrain.plugins.vision.export import PARITY_BATCHES, _held_out_batches

    session = make_session(path)
    floats = float_activations(model.model)
    worst, ratio, bound, images, agree, held = 0.0, 0.0, float("inf"), 0, 0, 0
    for k, x in enumerate(_held_out_batches(model, seed)):
        ref = model.model(x).float()
        limit = tolerance if tolerance is not None else \
            DEFAULT_TOLERANCE + 2.0 * float((ref - floats(x).float()).abs().max())
        got = run(session, {"images": x.numpy()})[0]
        err = float(np.abs(got - ref.numpy()).max())
        err = err if np.isfinite(err) else float("inf")
        worst, ratio, bound = max(worst, err), max(ratio, err / limit), min(bound, limit)
        images += len(x)
        if k < len(PARITY_BATCHES):  # the held-out batches (the last is noise)
            agree += int((got.argmax(-1) == ref.numpy().argmax(-1)).sum())
            held += len(x)
    return QatParity(worst, bound, ratio, len(PARITY_BATCHES) + 1, images, agree / held, ratio <= 1.0,
                     tolerance is not None)


def export_qat_classifier(model: ImageModel, out: Path, *, opset: int | None = None,
                          tolerance: float | None = None) -> dict[str, Any]:
    """Trace, quantise with the trained scales, gate and publish ``out``; on any failure nothing is left there.
    The report adds the benchmark figures of :mod:`.quantize` (held-out top-1, bytes, latency at 1 thread) of
    ``out`` against the traced float twin."""
    from crosstrain.plugins.export.onnx_export import _publish, check_onnx_out, staging
    from crosstrain.plugins.vision import quantize
    from crosstrain.plugins.vision.export import trace

    check_onnx_out(out)
    if not _static(model.model):
        raise ExportError(f"{model.source} was not trained with quant.qat=\"int8\"; export --int8 quantises a "
                          "floating-point classifier after training")
    with staging(out, "work") as work, staging(out) as pub:  # work: the float twin, never published
        fp = work / "float.onnx"
        trace(dataclasses.replace(model, model=float_twin(model.model)), fp, opset)
        stored = quantize_qat(model, fp, pub / out.name)
        parity = check_qat_parity(model, pub / out.name, tolerance=tolerance)
        if not parity.passed:
            raise ParityError(f"ONNX int8 QAT parity check failed: {parity.describe()}; nothing was written")
        figures = quantize.check_int8(model, fp, pub / out.name, min_agreement=0.0, max_drop_points=100.0)
        files = _publish(pub, out.name, out.parent)
    bench = {k: v for k, v in dataclasses.asdict(figures).items()
             if k not in ("min_agreement", "max_drop_points", "passed", "drop_points")}
    return {"path": str(out), "files": files, "stored_checked": stored, "parity": dataclasses.asdict(parity),
            "parity_line": parity.describe(), "figures": bench}
