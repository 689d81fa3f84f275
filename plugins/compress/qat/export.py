"""``crosstrain export --quantize`` / ``--ptq``: the integer ONNX model with its own parity gate against the
fake-quantised PyTorch model, and Hugging Face folders holding the dequantised weights."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.atomic import disk_errors
from crosstrain.plugins.compress.qat.convert import fake_quantised, integer_model, quantized_bytes
from crosstrain.plugins.compress.qat.schemes import Scheme
from crosstrain.plugins.export.parity import ParityReport

#: ``DequantizeLinear`` with int4 blocks needs opset 21.
MIN_OPSET = 21
META_QUANT = "crosstrain.quantization"


@dataclass
class QuantExportReport:
    """What a quantised export wrote, how close it is to the fake-quantised model, and its size."""

    path: str
    scheme: str
    group_size: int
    ptq: bool
    parity: ParityReport
    onnx_bytes: int
    weight_bytes: int
    layers: int
    files: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        how = "post-training quantization" if self.ptq else "as trained with QAT"
        return [f"wrote {self.path} ({self.scheme}, {how}, {self.layers} integer layers, "
                f"{self.onnx_bytes / 1e6:.2f} MB)", f"parity {self.scheme}: {self.parity.describe()}"]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "scheme": self.scheme, "group_size": self.group_size, "ptq": self.ptq,
                "parity": self.parity.to_dict(), "onnx_bytes": self.onnx_bytes, "weight_bytes": self.weight_bytes,
                "layers": self.layers}


def export_quantized_onnx(loaded: Any, out: str | os.PathLike[str], scheme: Scheme, *, ptq: bool = False,
                          tolerance: float | None = None, opset: int | None = None,
                          seed: int = 0) -> QuantExportReport:
    """Write ``out``: ``loaded``'s model (a :class:`~crosstrain.plugins.export.loading.LoadedModel`) computing in
    integers in onnxruntime (:mod:`~crosstrain.plugins.compress.qat.onnx_weights`), checked against the PyTorch
    model that computes the same integer ops (:mod:`~crosstrain.plugins.export.int_reference`) on several batches
    within the bound the gate derives (``tolerance``: a fixed bound instead); on any failure nothing is left at
    ``out``."""
    import onnx

    from crosstrain.plugins.compress.qat.linear import fake_quant_disabled
    from crosstrain.plugins.compress.qat.onnx_weights import integer_graph, nbits_block
    from crosstrain.plugins.export.int_model import ort_reference, quantize_embedding
    from crosstrain.plugins.export.int_parity import check_integer_parity
    from crosstrain.plugins.export.onnx_export import _publish, check_onnx_out, metadata, staging, trace_to_onnx

    out_path = Path(out)
    check_onnx_out(out_path)
    if scheme.weight_bits == 4 and not nbits_block(scheme.group_size):
        from crosstrain.errors import ConfigError

        raise ConfigError(f"int4 weights compute in onnxruntime's MatMulNBits, whose blocks are a power of two >= 16; "
                          f"group size {scheme.group_size} is not: use --group-size 32 (or train with it)")
    fake = fake_quantised(loaded.model, scheme, loaded.source).eval()
    converted, weights = integer_model(fake)
    embedding = quantize_embedding(converted)
    reference = ort_reference(converted, weights, embedding)
    meta = metadata(loaded, {META_QUANT: json.dumps({"scheme": scheme.name, "group_size": scheme.group_size,
                                                      "ptq": ptq, "embedding": "int8" if embedding else "fp32"})})
    with staging(out_path) as tmp_dir:
        tmp = tmp_dir / out_path.name
        with fake_quant_disabled(converted):  # float matmuls on q * s: traced, then rewritten to integer ops below
            trace_to_onnx(converted, tmp, meta, opset=max(opset or MIN_OPSET, MIN_OPSET))
            graph = onnx.load(str(tmp))
            integer_graph(graph, weights, embedding)
            for node in graph.graph.node:  # the exporter's per-node debug records (stack traces, source paths)
                del node.metadata_props[:]
            with disk_errors(out_path):
                onnx.save(graph, str(tmp))
            parity = check_integer_parity(reference, converted, tmp, tolerance=tolerance, seed=seed,
                                          label=scheme.name)
        size = tmp.stat().st_size
        files = _publish(tmp_dir, out_path.name, out_path.parent)
    layers = len(weights) + (1 if embedding is not None and embedding.head_block else 0)
    return QuantExportReport(str(out_path), scheme.name, scheme.group_size, ptq, parity, size,
                             quantized_bytes(weights), layers, files)


def trained_scheme(source: Any) -> Scheme | None:
    """The scheme ``source`` (a :class:`~crosstrain.checkpoint.resolve.Resolved`) was trained with: its run's
    ``[quant]``, or None (trained in floating point, or no run config beside it)."""
    from crosstrain.plugins.compress.qat.schemes import scheme
    from crosstrain.plugins.export.loading import run_config

    config = run_config(source.run_dir)
    if config is None:
        return None
    quant = config.section("quant")
    return None if quant.qat == "none" else scheme(quant.qat, quant.group_size)


def pick_scheme(source: Any, quantize: str | None, ptq: str | None, group_size: int | None) -> tuple[Scheme, bool]:
    """The scheme to export with and whether it is post-training quantization: ``--quantize [SCHEME]`` exports a
    QAT run as trained; ``--ptq SCHEME`` quantises a run trained in floating point. One-line errors otherwise."""
    from crosstrain.errors import ConfigError
    from crosstrain.plugins.compress.qat.schemes import scheme

    trained = trained_scheme(source)
    if ptq is not None:
        if trained is not None:
            raise ConfigError(f"{source.path} was trained with QAT (quant.qat={trained.name!r}); export it with "
                              "--quantize, not --ptq")
        return scheme(ptq, group_size or 32), True
    if trained is None:
        raise ConfigError(f"{source.path} was not trained with QAT (quant.qat=\"none\" or no run config); pass "
                          "--ptq SCHEME for post-training quantization")
    if quantize not in (None, "trained", trained.name) or group_size not in (None, trained.group_size):
        raise ConfigError(f"{source.path} was trained with quant.qat={trained.name!r}, group_size "
                          f"{trained.group_size}; drop the scheme/--group-size from --quantize to export it as trained")
    return trained, False


def dequantised_weights(src: Any, scheme: Scheme) -> Any:
    """``src`` (an hf_export ``WeightSource``) whose quantised layers' weights read as ``q * s``: the values the
    fake-quantised model computes with, in a floating-point folder transformers loads."""
    import dataclasses

    import torch

    from crosstrain.models.gpt import GPT
    from crosstrain.plugins.compress.qat.fake_quant import fake_quant_weight
    from crosstrain.plugins.compress.qat.linear import check_layers, quantizable

    with torch.device("meta"):
        layers = quantizable(GPT(src.config))
    check_layers(layers, scheme, src.source)
    groups = {f"{n}.weight": scheme.weight_group(m.in_features) for n, m in layers.items()}

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        out = src.load(names)
        with torch.no_grad():
            return {n: fake_quant_weight(t.float(), scheme.weight_bits, groups[n]).to(t.dtype) if n in groups else t
                    for n, t in out.items()}

    return dataclasses.replace(src, load=load)
