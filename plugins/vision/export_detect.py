"""``crosstrain export <detect run> --format onnx``: the detector, its post-processing included, as one ONNX graph.

Input ``images``: float32 ``[1, 3, H, W]``, RGB scaled to [0, 1] (``x / 255``), any ``H, W`` (the run evaluated
images resized so the longer side is ``detect.eval_size``; the graph normalises and pads them itself, as the
detector's own transform does). Outputs, the image's detections after torchvision's post-processing (score
threshold, per-level top-k, class-wise NMS, ``detections_per_img``), highest score first: ``boxes`` float32
``[N, 4]`` (x0, y0, x1, y1 in the input's pixels), ``scores`` float32 ``[N]``, ``labels`` int64 ``[N]`` (COCO
category ids; ``classes`` in the metadata names them), ``N`` >= 0 varying per image.

Why batch 1 and the TorchScript exporter: ``torch.onnx.export(dynamo=True)`` (torch 2.13) stops in torch.export on
the data-dependent branch of ``torchvision.ops.batched_nms`` (``GuardOnDataDependentSymNode``: "Could not guard on
data-dependent expression ... (torchvision/ops/boxes.py in _batched_nms_coordinate_trick)"). torchvision documents
its detectors as exportable with the TorchScript exporter (``dynamo=False``, opset >= 11), whose symbolic for
``torchvision::nms`` is ONNX ``NonMaxSuppression`` (torchvision/ops/_register_onnx_ops.py). Tracing unrolls the
detector's per-image post-processing loop, so the batch is fixed at trace time: one image per call, as
torchvision's own ONNX tests run these models; ``H`` and ``W`` stay dynamic.

The parity gate (:func:`check_detect_parity`) runs onnxruntime and PyTorch on the run's held-out images, noise, a
non-square noise image and a grey one, and asks per image: the same number of detections, the same labels in the
same order, scores within ``tolerance`` and box coordinates within ``box_tolerance`` pixels (:class:`Bounds`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from crosstrain.plugins.export.errors import ExportError, ParityError
from crosstrain.plugins.vision.load import ImageModel

#: ONNX opset of the TorchScript exporter unless --opset (>= 11: NonMaxSuppression; torchvision's symbolic needs it)
DETECT_OPSET = 17
MIN_OPSET = 11
#: held-out images the gate runs (the first ones of the split, cycled if fewer), then the synthetic ones
PARITY_IMAGES = 16
NOISE_IMAGES = 3
OUTPUTS = ("boxes", "scores", "labels")


class SingleImageDetector(nn.Module):
    """A torchvision detector as a function of one image tensor: ``[1, 3, H, W]`` -> ``(boxes, scores, labels)``."""

    def __init__(self, detector: nn.Module) -> None:
        super().__init__()
        self.detector = detector

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        det = self.detector([images[0]])[0]
        return det["boxes"], det["scores"], det["labels"]


@dataclass(frozen=True)
class Bounds:
    """The gate's bounds, derived from ``tolerance``, the export plugin's fp32 bound on a network output (1e-4).

    Scores: FCOS's is ``sqrt(sigmoid(c) * sigmoid(t))`` (class and centerness logits), RetinaNet's ``sigmoid(c)``;
    each partial derivative is at most 1/2, so logits within ``tolerance`` give scores within ``tolerance``.
    Boxes: a coordinate is an anchor point plus regression outputs times a length (FCOS: the anchor's side;
    RetinaNet: the anchor's side for the centre, the predicted side ``exp(dw) * w`` / 2 for the half-width), so an
    error of ``tolerance`` moves it by at most ``tolerance * (largest anchor side + longest side a box can have
    inside the image)``; the image's longer side stands for the latter (an approximation: a box with both edges
    inside the image is no longer than it; the measured errors sit orders of magnitude below the bound).
    """

    tolerance: float
    anchor_side: float
    image_side: int

    @property
    def score(self) -> float:
        return self.tolerance

    @property
    def box(self) -> float:
        return self.tolerance * (self.anchor_side + self.image_side)


@dataclass
class DetectParity:
    """onnxruntime vs PyTorch on ``images`` images (``detections`` detections in all, PyTorch's count); errors are
    over matched pairs; ``unmatched`` counts PyTorch's detections without an onnxruntime match (:func:`match`: only
    ties at a cut when the gate passes)."""

    tolerance: float
    score_tolerance: float
    box_tolerance_px: float
    max_score_err: float
    max_box_err_px: float
    images: int
    detections: int
    counts_equal: bool
    all_matched: bool
    unmatched: int
    passed: bool
    first_mismatch: str

    def describe(self) -> str:
        verdict = "ok" if self.passed else f"FAILED ({self.first_mismatch})"
        if self.passed:
            same = "every detection matched" if not self.unmatched else \
                f"every detection matched but {self.unmatched} kept by one side only at a score tie at the cut"
        else:
            same = f"counts differ or {self.unmatched} detections unmatched"
        return (f"{self.detections} detections on {self.images} images, {same}, max box error "
                f"{self.max_box_err_px:.3g} px (<= {self.box_tolerance_px:.3g}), max score error "
                f"{self.max_score_err:.3g} (<= {self.score_tolerance:g}): {verdict}")


@dataclass
class ImageMatch:
    """One image's comparison (:func:`match`)."""

    matched: int
    unmatched: int
    max_box_err: float
    max_score_err: float
    problem: str  # "" when the image passes


def match(ref: list[np.ndarray], got: list[np.ndarray], bounds: Bounds) -> ImageMatch:
    """Pair each PyTorch detection (``boxes, scores, labels``) with an unused onnxruntime one of the same label,
    score within ``bounds.score`` and box within ``bounds.box`` (the closest box). Equal counts are required.

    Order is not compared, and a detection may go unmatched on both sides only when its score is within the
    score bound of its side's lowest kept score: where ``detections_per_img`` or a top-k cuts between scores
    closer than fp32 can order, either side may keep either detection (an untrained RetinaNet's scores all sit
    near its prior, 0.01, and swap so). Anything else unmatched fails the image."""
    (rb, rs, rl), (gb, gs, gl) = ref, got
    if len(gl) != len(rl):
        return ImageMatch(0, 0, 0.0, 0.0, f"{len(gl)} detections vs PyTorch's {len(rl)}")
    used = np.zeros(len(gl), dtype=bool)
    box_err = score_err = 0.0
    unmatched: list[int] = []
    for i in range(len(rl)):
        errs = np.abs(gb - rb[i]).max(axis=1) if len(gl) else np.zeros(0)
        ok = ~used & (gl == rl[i]) & (np.abs(gs - rs[i]) <= bounds.score) & (errs <= bounds.box)
        if not ok.any():
            unmatched.append(i)
            continue
        j = int(np.flatnonzero(ok)[np.argmin(errs[ok])])
        used[j] = True
        box_err, score_err = max(box_err, float(errs[j])), max(score_err, float(abs(gs[j] - rs[i])))
    problem = ""
    if unmatched:
        lone_ref = rs[unmatched]
        lone_got = gs[~used]
        if (lone_ref - rs.min() > bounds.score).any() or (lone_got - gs.min() > bounds.score).any():
            i = unmatched[0]
            problem = (f"PyTorch's detection {i} (label {int(rl[i])}, score {float(rs[i]):.4g}) has no onnxruntime "
                       "match within the bounds")
    return ImageMatch(len(rl) - len(unmatched), len(unmatched), box_err, score_err, problem)


def largest_anchor_side(detector: nn.Module) -> float:
    """The longest side of the detector's anchors (the largest length a regression output is multiplied by)."""
    generator: Any = detector.anchor_generator
    cells = generator.cell_anchors
    return max(float((a[:, 2:] - a[:, :2]).max()) for a in cells)


def parity_images(model: ImageModel, seed: int = 0) -> list[torch.Tensor]:
    """The gate's inputs, float ``[3, H, W]`` in [0, 1]: the first ``PARITY_IMAGES`` held-out images as evaluation
    feeds them (:class:`~crosstrain.plugins.vision.detect.data.DetectDataset` at ``eval_size``), then
    ``NOISE_IMAGES`` of uniform noise at the eval size, one of noise at 3/4 of it in height (a non-square input:
    ``H, W`` are dynamic) and a mid-grey one (few or no detections: the empty path of the post-processing)."""
    from crosstrain.engine.recipe import resolve_recipe
    from crosstrain.plugins.vision.detect.data import DetectDataset

    recipe = resolve_recipe("detect")
    recipe.validate(model.config)
    recipe._load(model.config)
    size = model.shape[1]
    held = DetectDataset(recipe.val_samples, sizes=[size], seed=0)
    out = [held.sample(i % len(held), 0, size)[0] for i in range(PARITY_IMAGES)]
    gen = torch.Generator().manual_seed(seed)
    out += [torch.rand((3, size, size), generator=gen) for _ in range(NOISE_IMAGES)]
    out.append(torch.rand((3, max(16, size * 3 // 4), size), generator=gen))
    out.append(torch.full((3, size, size), 0.5))
    return out


@torch.no_grad()
def check_detect_parity(model: ImageModel, onnx_path: Path, tolerance: float, seed: int = 0) -> DetectParity:
    """Every :func:`parity_images` image through onnxruntime and PyTorch, compared by :func:`match`."""
    from crosstrain.plugins.export.runtime import make_session, run

    session = make_session(onnx_path)
    wrapped = SingleImageDetector(model.model).eval()
    images = parity_images(model, seed)
    bounds = Bounds(tolerance, largest_anchor_side(model.model), max(model.shape[1:]))
    box_err = score_err = 0.0
    counts, matched, unmatched, detections, mismatch = True, True, 0, 0, ""
    for k, img in enumerate(images):
        ref = [t.numpy() for t in wrapped(img[None])]
        got = run(session, {"images": img[None].numpy()})
        m = match(ref, got, bounds)
        detections += len(ref[2])
        counts = counts and len(got[2]) == len(ref[2])
        matched = matched and not m.problem
        unmatched += m.unmatched
        box_err, score_err = max(box_err, m.max_box_err), max(score_err, m.max_score_err)
        if m.problem and not mismatch:
            mismatch = f"image {k}: {m.problem}"
    passed = counts and matched
    return DetectParity(tolerance, bounds.score, bounds.box, score_err, box_err, len(images), detections, counts,
                        matched, unmatched, passed, mismatch)


def metadata(model: ImageModel) -> dict[str, object]:
    """What a client needs beside the graph: class names by label, the expected input, what the outputs are."""
    det = model.model
    return {"recipe": "detect", "classes": model.classes, "channels": 3, "size": list(model.shape[1:]),
            "eval_size": model.shape[1], "batch": 1, "scale": "x / 255",
            "input": "RGB float32 [1, 3, H, W] in [0, 1], resized so the longer side is eval_size",
            "mean": [float(v) for v in det.transform.image_mean], "std": [float(v) for v in det.transform.image_std],
            "normalized_in_graph": True, "outputs": {"boxes": "float32 [N, 4] x0 y0 x1 y1 input pixels",
                                                     "scores": "float32 [N] descending", "labels": "int64 [N]"},
            "score_thresh": float(det.score_thresh), "nms_thresh": float(det.nms_thresh),
            "detections_per_img": int(det.detections_per_img), "model": type(det).__name__,
            "source": model.source, "step": model.step, "params_sha256": model.params_sha256}


def trace_detector(model: ImageModel, path: Path, opset: int | None, meta_key: str) -> None:
    """Write the detector at ``path`` (TorchScript exporter, module docstring says why) with its metadata."""
    import onnx

    from crosstrain.checkpoint.atomic import disk_errors
    from crosstrain.plugins.export.onnx_export import _quiet, root_cause

    opset = DETECT_OPSET if opset is None else opset
    if opset < MIN_OPSET:
        raise ExportError(f"--opset {opset} has no NonMaxSuppression; a detector exports with --opset >= {MIN_OPSET}")
    example = parity_images(model)[0][None]
    axes = {"images": {2: "height", 3: "width"}, **{name: {0: "detections"} for name in OUTPUTS}}
    try:
        with _quiet(), disk_errors(path):
            torch.onnx.export(SingleImageDetector(model.model).eval(), (example,), str(path), dynamo=False,
                              opset_version=opset, input_names=["images"], output_names=list(OUTPUTS),
                              dynamic_axes=axes)
    except ExportError:
        raise
    except Exception as exc:
        raise ExportError(f"torch.onnx.export (TorchScript) failed for this detector: {root_cause(exc)}") from exc
    graph = onnx.load(str(path))
    graph.metadata_props.add(key=meta_key, value=json.dumps(metadata(model)))
    with disk_errors(path):
        onnx.save(graph, str(path))


def export_detector(model: ImageModel, out: Path, *, tolerance: float, opset: int | None,
                    meta_key: str) -> dict[str, Any]:
    """Trace into a temp folder beside ``out``, gate, then rename into place; on any failure nothing is left."""
    from crosstrain.plugins.export.onnx_export import _publish, check_onnx_out, staging

    check_onnx_out(out)
    with staging(out) as tmp_dir:
        trace_detector(model, tmp_dir / out.name, opset, meta_key)
        parity = check_detect_parity(model, tmp_dir / out.name, tolerance)
        if not parity.passed:
            raise ParityError(f"ONNX detector parity check failed: {parity.describe()}; nothing was written (raise "
                              "--tolerance only if this error is acceptable)")
        files = _publish(tmp_dir, out.name, out.parent)
    return {"path": str(out), "files": files, "parity": asdict(parity), "parity_line": parity.describe()}
