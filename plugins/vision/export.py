"""``crosstrain export <classify run> --format onnx``: the classifier as an ONNX graph, ``images`` (float32
``[batch, C, H, W]``, the run's held-out preprocessing: :meth:`~crosstrain.plugins.vision.load.ImageModel.preprocess`)
-> ``logits`` ``[batch, classes]``, with a dynamic batch axis and the class names and preprocessing in its
``metadata_props``. Written only if it passes the export plugin's fp32 parity gate (max abs logit error of
onnxruntime vs PyTorch <= ``DEFAULT_TOLERANCE``, 1e-4) on several batches of the run's held-out images and one of
noise. ``--int8`` also writes ``<out stem>.int8.onnx``, the static int8 model of :mod:`.quantize`, only if it passes
that module's top-1 gate (nothing at either path otherwise). A run trained with ``quant.qat = "int8"`` exports its
integer model with ``--quantize`` (:mod:`.qat_export`). A detect run exports through :mod:`.export_detect` (fp32
only). The flags that do not apply to a conv net are refused in one line (docs/vision.md says why)."""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crosstrain.plugins.export.errors import ExportError, ParityError
from crosstrain.plugins.vision.load import ImageModel

#: ONNX metadata key of the preprocessing and class names a client needs
META_IMAGES = "crosstrain.images"
#: batch sizes the parity gate runs (held-out images), then one batch of noise of the first size
PARITY_BATCHES = (1, 7, 16, 64)


@dataclass
class ImageParity:
    """Max abs logit error of onnxruntime vs PyTorch over ``batches`` batches (``images`` images in all) and
    whether the two agree on every image's top-1."""

    tolerance: float
    max_abs_err: float
    batches: int
    images: int
    top1_agree: bool
    passed: bool

    def describe(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        agree = "the same top-1 on every image" if self.top1_agree else "top-1 differs on some images"
        return (f"max abs logit error {self.max_abs_err:.3g} over {self.batches} batches ({self.images} images), "
                f"{agree}, tolerance {self.tolerance:g}: {verdict}")


def refuse(recipe: str, args: argparse.Namespace) -> None:
    """One-line refusals of what this export does not do, before anything is loaded or written."""
    if recipe == "detect" and getattr(args, "quantize", None) is not None:
        raise ExportError("--quantize exports a QAT-trained classifier; a --recipe detect run has no integer export: "
                          "drop the flag for the gated fp32 detector")
    if getattr(args, "ptq", None) is not None:
        raise ExportError(f"--ptq quantises a GPT's linear layers; a --recipe {recipe} conv net is quantised after "
                          "training with --int8 (onnxruntime static int8), or exported as trained with --quantize")
    if getattr(args, "quantize", None) not in (None, "trained", "int8"):
        raise ExportError(f"--quantize {args.quantize}: a --recipe {recipe} conv net trains and exports int8 only; "
                          "pass --quantize (the scheme it was trained with)")
    if getattr(args, "group_size", None) is not None:
        raise ExportError(f"--group-size sets int4 weight groups; a --recipe {recipe} conv net's int8 weights have one "
                          "scale per output channel: drop the flag")
    if getattr(args, "quantize", None) is not None and args.int8:
        raise ExportError("--quantize writes the QAT run's integer model and --int8 quantises a floating-point one "
                          "after training; pass one")
    if args.format != "onnx":
        kind = "a detector" if recipe == "detect" else "an image classifier"
        raise ExportError(f"--format {args.format} exports a language model; {kind} exports with --format onnx")
    if recipe == "detect" and args.int8:
        raise ExportError("--int8 is not built for a --recipe detect run (static int8 calibration and its gate are "
                          "the classifier's); drop --int8 for the gated fp32 detector")
    from crosstrain.plugins.export.defaults import DEFAULT_INT8_TOLERANCE

    if args.int8_tolerance != DEFAULT_INT8_TOLERANCE:
        raise ExportError("--int8-tolerance bounds a GPT's int8 logit error; a classifier's --int8 gate is held-out "
                          "top-1 agreement with fp32 (>= 99%) and accuracy drop (<= 0.5 points): drop the flag")


def _held_out_batches(model: ImageModel, seed: int) -> list[torch.Tensor]:
    """The parity inputs: the first ``PARITY_BATCHES`` held-out images of the run (cycled if fewer), then noise."""
    from crosstrain.plugins.vision.data.sources import build_sources

    _, held = build_sources(model.config.section("vision"))
    out, start = [], 0
    for size in PARITY_BATCHES:
        idx = [(start + i) % len(held) for i in range(size)]
        out.append(model.preprocess([held.load(i) for i in idx]))
        start += size
    gen = torch.Generator().manual_seed(seed)
    out.append(torch.randn((PARITY_BATCHES[0] * 3, *model.shape), generator=gen))
    return out


@torch.no_grad()
def check_image_parity(model: ImageModel, onnx_path: Path, tolerance: float, seed: int = 0) -> ImageParity:
    from crosstrain.plugins.export.runtime import make_session, run

    session = make_session(onnx_path)
    worst, agree, images = 0.0, True, 0
    batches = _held_out_batches(model, seed)
    for x in batches:
        ref = model.model(x).float().numpy()
        got = run(session, {"images": x.numpy()})[0]
        err = float(np.abs(got - ref).max())
        worst = max(worst, err if np.isfinite(err) else float("inf"))
        agree = agree and bool((got.argmax(-1) == ref.argmax(-1)).all())
        images += len(x)
    return ImageParity(tolerance, worst, len(batches), images, agree, worst <= tolerance)


def trace(model: ImageModel, path: Path, opset: int | None) -> None:
    from torch.export import Dim

    from crosstrain.checkpoint.atomic import disk_errors
    from crosstrain.plugins.export.onnx_export import _quiet, root_cause

    example = torch.zeros((2, *model.shape))  # a batch of 2, so the batch axis is not specialised to 1
    try:
        with _quiet():
            program = torch.onnx.export(model.model, (example,), dynamo=True, input_names=["images"],
                                        output_names=["logits"], opset_version=opset, verbose=False, optimize=True,
                                        dynamic_shapes=({0: Dim("batch", min=1, max=65536)},))
    except Exception as exc:
        raise ExportError(f"torch.onnx.export failed for this classifier: {root_cause(exc)}") from exc
    if program is None:
        raise ExportError("torch.onnx.export returned no program")
    meta = {"recipe": "classify", "classes": model.classes, "channels": model.channels, "size": list(model.shape[1:]),
            "image_size": model.image_size, "mean": model.mean or [0.5] * model.channels,
            "std": model.std or [0.5] * model.channels, "scale": "x / 255", "source": model.source,
            "step": model.step, "params_sha256": model.params_sha256}
    program.model.metadata_props.update({META_IMAGES: json.dumps(meta)})
    with _quiet(), disk_errors(path):
        program.save(str(path))


def export_classifier(model: ImageModel, out: Path, *, tolerance: float, opset: int | None = None,
                      int8: bool = False, min_agreement: float | None = None,
                      max_drop_points: float | None = None) -> dict[str, Any]:
    """Trace, gate and publish ``out`` (the model file renamed into place last); with ``int8`` also quantize, gate
    and publish ``<out stem>.int8.onnx`` (:mod:`.quantize`'s bounds unless given). On any failure nothing is left."""
    from crosstrain.plugins.export.onnx_export import _publish, check_onnx_out, int8_path_for, staging
    from crosstrain.plugins.vision import quantize

    check_onnx_out(out)
    gate: quantize.Int8Gate | None = None
    with contextlib.ExitStack() as stack:
        tmp_dir = stack.enter_context(staging(out))
        trace(model, tmp_dir / out.name, opset)
        parity = check_image_parity(model, tmp_dir / out.name, tolerance)
        if not parity.passed:
            raise ParityError(f"ONNX fp32 parity check failed: {parity.describe()}; nothing was written (raise the "
                              "tolerance with --tolerance only if this error is acceptable)")
        q_dir: Path | None = None  # the int8 file's own folder: _publish moves every file of a folder
        if int8:
            q_dir = stack.enter_context(staging(out, "int8"))
            q_path = q_dir / int8_path_for(out).name
            quantize.quantize_classifier(model, tmp_dir / out.name, q_path)
            gate = quantize.check_int8(
                model, tmp_dir / out.name, q_path,
                min_agreement=quantize.MIN_AGREEMENT if min_agreement is None else min_agreement,
                max_drop_points=quantize.MAX_DROP_POINTS if max_drop_points is None else max_drop_points)
            if not gate.passed:
                raise ParityError(f"ONNX int8 gate failed: {gate.describe()}; nothing was written (export fp32 "
                                  "without --int8)")
        files = _publish(tmp_dir, out.name, out.parent)
        if q_dir is not None:
            files += _publish(q_dir, int8_path_for(out).name, out.parent)
    report = {"path": str(out), "files": files, "parity": asdict(parity), "parity_line": parity.describe()}
    if gate is not None:
        report.update(int8_path=str(int8_path_for(out)), int8=asdict(gate), int8_line=gate.describe())
    return report


def run_image_export(args: argparse.Namespace, source: str, out: Path | None) -> int:
    """``crosstrain export`` on a classify or detect run (the export CLI dispatches here)."""
    from crosstrain.plugins.export.cli import default_out
    from crosstrain.plugins.vision.load import load_image_model, run_recipe

    refuse(str(run_recipe(source)), args)
    model = load_image_model(source, best=args.best)
    qat = trained_qat(model)
    if args.quantize is not None or qat:
        return _run_qat_export(args, model, qat, out)
    target = out if out is not None else default_out(Path(source), "onnx")
    if model.recipe == "detect":
        from crosstrain.plugins.vision.export_detect import export_detector

        report = export_detector(model, target, tolerance=args.tolerance, opset=args.opset, meta_key=META_IMAGES)
    else:
        report = export_classifier(model, target, tolerance=args.tolerance, opset=args.opset, int8=args.int8)
    if args.json:
        print(json.dumps({"source": model.source, "format": "onnx", "recipe": model.recipe, "step": model.step,
                          "classes": model.classes, **report}))
    else:
        print(f"wrote {target}")
        print(f"parity fp32: {report['parity_line']}")
        if args.int8:
            print(f"wrote {report['int8_path']}")
            print(f"gate int8: {report['int8_line']}")
    return 0


def trained_qat(model: ImageModel) -> bool:
    """Whether the run was trained with ``quant.qat`` (its model carries the fake quantisers)."""
    from crosstrain.plugins.compress.qat.conv import static_layers

    return bool(static_layers(model.model))


def _run_qat_export(args: argparse.Namespace, model: ImageModel, qat: bool, out: Path | None) -> int:
    """A QAT run: ``--quantize`` writes its integer model (:mod:`.qat_export`); without it, its float weights (fake
    quantisation off, gated against the same in PyTorch). ``--quantize`` on a float run, ``--int8`` on a QAT one:
    one line each."""
    from crosstrain.plugins.compress.qat.linear import fake_quant_disabled
    from crosstrain.plugins.export.cli import default_out
    from crosstrain.plugins.export.onnx_export import int8_path_for

    if not qat:
        raise ExportError(f"{model.source} was not trained with QAT (quant.qat=\"none\"); --int8 quantises it after "
                          "training (drop --quantize)")
    if args.int8:
        raise ExportError(f"{model.source} was trained with quant.qat=\"int8\"; export its integer model as trained "
                          "with --quantize, not --int8")
    if args.quantize is None:
        target = out if out is not None else default_out(Path(model.source), "onnx")
        with fake_quant_disabled(model.model):
            report = export_classifier(model, target, tolerance=args.tolerance, opset=args.opset)
        lines = [f"wrote {target} (the QAT run's float weights; --quantize writes its integer model)",
                 f"parity fp32: {report['parity_line']}"]
    else:
        from crosstrain.plugins.vision.qat_export import export_qat_classifier

        target = out if out is not None else int8_path_for(default_out(Path(model.source), "onnx"))
        report = export_qat_classifier(model, target, opset=args.opset,
                                       tolerance=getattr(args, "quant_tolerance", None))
        f = report["figures"]
        lines = [f"wrote {target} (int8 as trained with QAT, {f['int8_bytes']:,} bytes)",
                 f"parity int8: {report['parity_line']}",
                 f"held-out top-1 {f['int8_top1']:.4f} (its float weights {f['fp32_top1']:.4f}) on {f['images']} "
                 f"images; {f['int8_latency_us']:.0f} us/image vs float {f['fp32_latency_us']:.0f} at 1 thread"]
    if args.json:
        print(json.dumps({"source": model.source, "format": "onnx", "recipe": model.recipe, "step": model.step,
                          "classes": model.classes, "quantize": args.quantize is not None, **report}))
    else:
        print("\n".join(lines))
    return 0
