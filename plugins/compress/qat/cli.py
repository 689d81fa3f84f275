"""``crosstrain export ... --quantize [SCHEME]`` / ``--ptq SCHEME``: the export plugin hands these flags here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from crosstrain.errors import ConfigError
from crosstrain.plugins.compress.qat.schemes import SCHEMES


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The quantisation flags of ``crosstrain export``."""
    p.add_argument("--quantize", nargs="?", const="trained", default=None, choices=("trained", *SCHEMES),
                   help="write the integer model of a run trained with [quant] qat (onnx: int weights + parity "
                        "against the fake-quantised model; hf: dequantised weights)")
    p.add_argument("--ptq", default=None, choices=SCHEMES,
                   help="post-training quantization of a run trained in floating point, with this scheme")
    p.add_argument("--group-size", type=int, default=None, help="--ptq int4 weights: input features per scale")
    p.add_argument("--quant-tolerance", type=float, default=None,
                   help="a fixed max abs logit error for the integer ONNX model's parity gate, instead of the bound "
                        "it derives per step (docs/export.md)")


def run_quantized_export(args: argparse.Namespace, out: Path | None) -> int:
    """Export ``args.source`` quantised in ``args.format`` to ``out`` (default: beside the plain export)."""
    from crosstrain.checkpoint.resolve import resolve_path
    from crosstrain.plugins.compress.qat.export import dequantised_weights, export_quantized_onnx, pick_scheme
    from crosstrain.plugins.export.cli import default_out

    if args.quantize is not None and args.ptq is not None:
        raise ConfigError("--quantize exports a QAT run as trained and --ptq quantises a floating-point one; pass one")
    if args.format == "safetensors":
        raise ConfigError("--quantize/--ptq write --format onnx (integer weights) or hf (dequantised weights)")
    if args.group_size is not None and args.group_size < 2:
        raise ConfigError(f"--group-size must be >= 2, got {args.group_size}")
    if args.quant_tolerance is not None and not args.quant_tolerance >= 0:
        raise ConfigError(f"--quant-tolerance must be >= 0 (a max abs logit error), got {args.quant_tolerance}")
    source = resolve_path(args.source, best=args.best)
    scheme, ptq = pick_scheme(source, args.quantize, args.ptq, args.group_size)
    if out is None:
        plain = default_out(Path(args.source), args.format)
        out = plain.with_name(f"{plain.stem}.{scheme.name}{plain.suffix}")
    if args.format == "hf":
        from crosstrain.plugins.export.hf_export import export_hf

        report = export_hf(args.source, out, max_shard_size=args.max_shard_size, dtype=args.dtype, best=args.best,
                           weights=lambda src: dequantised_weights(src, scheme))
        report.update(scheme=scheme.name, group_size=scheme.group_size, ptq=ptq)
        print(json.dumps({"format": "hf", **report}) if args.json else
              f"wrote {out} ({report['model_type']}, {scheme.name} weights dequantised, {args.dtype})")
        return 0
    from crosstrain.plugins.export.loading import load_model

    result = export_quantized_onnx(load_model(source), out, scheme, ptq=ptq, tolerance=args.quant_tolerance,
                                   opset=args.opset)
    print(json.dumps({"format": "onnx", **result.to_dict()}) if args.json else "\n".join(result.lines()))
    return 0
