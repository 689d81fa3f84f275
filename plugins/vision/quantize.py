"""``crosstrain export <classify run> --int8``: post-training static int8 quantization of the exported classifier
with onnxruntime's own tools (``quant_pre_process``, then ``quantize_static`` in QDQ format, int8 weights per
output channel, activation ranges calibrated (MinMax) on ``CALIBRATION_IMAGES`` training images of the run through
its held-out preprocessing), and the gate the int8 file must pass: its held-out top-1 against the fp32 file's.

The gate: top-1 agreement with the fp32 model on >= ``MIN_AGREEMENT`` of the held-out images AND a held-out
accuracy drop <= ``MAX_DROP_POINTS`` points. Why these bounds: 0.5 points is the bound the vision issue uses for
"the same accuracy" (crosstrain vs timm); 99% agreement allows the images whose fp32 top-2 margin is within int8
rounding (a few in a hundred near the decision boundary) to flip, not a systematic error, which would flip many.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crosstrain.plugins.vision.load import ImageModel

#: training images the activation ranges are calibrated on (the first ones of the run's train split)
CALIBRATION_IMAGES = 256
#: the int8 gate (module docstring says why)
MIN_AGREEMENT = 0.99
MAX_DROP_POINTS = 0.5
#: the held-out images the gate scores (the first ones of the split; digits has 368)
GATE_IMAGES = 5000
#: held-out images timed one at a time for the latency figure
LATENCY_IMAGES = 32
BATCH = 64


@dataclass
class Int8Gate:
    """The int8 file against the fp32 one on ``images`` held-out images, and the benchmark figures of both."""

    images: int
    top1_agreement: float
    fp32_top1: float
    int8_top1: float
    drop_points: float
    min_agreement: float
    max_drop_points: float
    passed: bool
    fp32_bytes: int
    int8_bytes: int
    size_ratio: float
    fp32_latency_us: float  # per image, batch 1, 1 onnxruntime thread (a benchmark figure, not a gate)
    int8_latency_us: float
    latency_ratio: float

    def describe(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        return (f"top-1 agreement {self.top1_agreement:.4f} (>= {self.min_agreement:g}) on {self.images} held-out "
                f"images, top-1 {self.fp32_top1:.4f} -> {self.int8_top1:.4f} (drop {self.drop_points:.2f} points, "
                f"<= {self.max_drop_points:g}): {verdict}; {self.int8_bytes:,} bytes ({self.size_ratio:.2f}x fp32), "
                f"{self.int8_latency_us:.0f} us/image vs fp32 {self.fp32_latency_us:.0f} at 1 thread")


def _calibration_reader(model: ImageModel) -> Any:
    """onnxruntime's ``CalibrationDataReader`` over the first ``CALIBRATION_IMAGES`` training images."""
    from onnxruntime.quantization import CalibrationDataReader

    from crosstrain.plugins.vision.data.sources import build_sources

    train, _ = build_sources(model.config.section("vision"))
    n = min(CALIBRATION_IMAGES, len(train))

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.starts = iter(range(0, n, BATCH))

        def get_next(self) -> dict[str, np.ndarray] | None:
            start = next(self.starts, None)
            if start is None:
                return None
            batch = [train.load(i) for i in range(start, min(start + BATCH, n))]
            return {"images": model.preprocess(batch).numpy()}

    return Reader()


def quantize_classifier(model: ImageModel, src: Path, dst: Path, *, signed_activations: bool = False) -> None:
    """Write ``dst``: the fp32 classifier ``src`` with its Conv/Gemm/MatMul inputs as QDQ int8, its metadata kept.

    Activations are uint8 and weights int8 (U8S8) unless ``signed_activations`` (S8S8): on x86 onnxruntime ran the
    U8S8 digits CNN in 0.9-1.2x fp32's time, the S8S8 one in 2.3-2.4x (benchmarks/vision_int8.py, docs/vision.md)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from crosstrain.plugins.export.quantize import carry_metadata, quantizer_errors

    prepared = dst.with_name(dst.stem + ".pre.onnx")
    try:
        with quantizer_errors("int8 quantization of the classifier"):
            # onnxruntime's recommended first step: shape inference and graph optimisation before quantizing
            quant_pre_process(str(src), str(prepared))
            activations = QuantType.QInt8 if signed_activations else QuantType.QUInt8
            quantize_static(str(prepared), str(dst), _calibration_reader(model), quant_format=QuantFormat.QDQ,
                            per_channel=True, activation_type=activations, weight_type=QuantType.QInt8,
                            op_types_to_quantize=["Conv", "Gemm", "MatMul"])
    finally:
        prepared.unlink(missing_ok=True)
    carry_metadata(src, dst, "int8-static-qdq")


def _held_out(model: ImageModel) -> tuple[np.ndarray, np.ndarray]:
    from crosstrain.plugins.vision.data.sources import build_sources

    _, held = build_sources(model.config.section("vision"))
    n = min(GATE_IMAGES, len(held))
    x = np.concatenate([model.preprocess([held.load(i) for i in range(s, min(s + BATCH, n))]).numpy()
                        for s in range(0, n, BATCH)])
    return x, np.asarray(held.labels[:n])


def _top1(session: Any, x: np.ndarray) -> np.ndarray:
    from crosstrain.plugins.export.runtime import run

    return np.concatenate([run(session, {"images": x[s:s + BATCH]})[0].argmax(-1) for s in range(0, len(x), BATCH)])


def _latency_us(sessions: list[Any], x: np.ndarray, rounds: int = 3) -> list[float]:
    """Per-image seconds (in us) of each session on batch-1 inputs, the best of ``rounds`` interleaved rounds."""
    best = [float("inf")] * len(sessions)
    for _ in range(rounds):
        for k, session in enumerate(sessions):
            t0 = time.perf_counter()
            for i in range(len(x)):
                session.run(None, {"images": x[i:i + 1]})
            best[k] = min(best[k], (time.perf_counter() - t0) / len(x) * 1e6)
    return best


def check_int8(model: ImageModel, fp32: Path, int8: Path, *, min_agreement: float = MIN_AGREEMENT,
               max_drop_points: float = MAX_DROP_POINTS) -> Int8Gate:
    """Score both files on the run's held-out images (1 onnxruntime thread each) and apply the gate."""
    from crosstrain.plugins.export.runtime import make_session

    x, labels = _held_out(model)
    s32, s8 = make_session(fp32, threads=1), make_session(int8, threads=1)
    p32, p8 = _top1(s32, x), _top1(s8, x)
    agreement = float((p32 == p8).mean())
    acc32, acc8 = float((p32 == labels).mean()), float((p8 == labels).mean())
    drop = (acc32 - acc8) * 100
    lat32, lat8 = _latency_us([s32, s8], x[:LATENCY_IMAGES])
    b32, b8 = fp32.stat().st_size, int8.stat().st_size
    passed = agreement >= min_agreement and drop <= max_drop_points
    return Int8Gate(len(x), agreement, acc32, acc8, drop, min_agreement, max_drop_points, passed, b32, b8, b8 / b32,
                    lat32, lat8, lat8 / lat32)
