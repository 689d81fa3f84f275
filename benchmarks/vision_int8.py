"""A default ``--recipe classify`` run on the embedded digits, exported with ``crosstrain export --int8`` (the
``crosstrain`` command, as a user runs it), then the fp32 and int8 files timed side by side in onnxruntime at 1
thread: batch 1 and batch 64 over all 368 held-out digits, interleaved rounds, the best round of each.

Last line: JSON with the export's gate figures (``top1_agreement``, ``fp32_top1``, ``int8_top1``,
``drop_points``), ``size_ratio`` (int8 bytes / fp32 bytes) and ``latency_ratio_b1`` / ``latency_ratio_b64``
(int8 / fp32 seconds per image; < 1 is faster), and ``s8s8_latency_ratio_*``: the same for an S8S8 (int8
activations) quantization of the same file, the variant the export does not take.

    python benchmarks/vision_int8.py [--steps 400] [--rounds 7] [--image-size 0]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def per_image_us(session: object, x: np.ndarray, batch: int) -> float:
    t0 = time.perf_counter()
    for start in range(0, len(x), batch):
        session.run(None, {"images": x[start:start + batch]})  # type: ignore[attr-defined]
    return (time.perf_counter() - t0) / len(x) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--image-size", type=int, default=0, help="vision.image_size (0: the digits' own 8x8)")
    args = parser.parse_args()
    from crosstrain.plugins.export.runtime import make_session
    from crosstrain.plugins.vision.data.sources import digits
    from crosstrain.plugins.vision.load import load_image_model
    from crosstrain.plugins.vision.quantize import quantize_classifier

    cli = [sys.executable, "-m", "crosstrain"]
    with tempfile.TemporaryDirectory(prefix="vision-int8-") as tmp:
        run, out = Path(tmp) / "run", Path(tmp) / "digits.onnx"
        subprocess.run([*cli, "train", "--recipe", "classify", "--run-dir", str(run), "--set", "logging.progress=none",
                        "--set", f"train.steps={args.steps}", "--set", "eval.max_batches=0", "--set",
                        f"eval.every={args.steps}", "--set", f"checkpoint.every={args.steps}",
                        "--set", f"vision.image_size={args.image_size}"],
                       check=True, stdout=subprocess.DEVNULL)
        done = subprocess.run([*cli, "export", str(run), "--out", str(out), "--int8", "--json"], check=True,
                              capture_output=True, text=True)
        report = json.loads(done.stdout.strip().splitlines()[-1])
        gate = report["int8"]
        _, held = digits()
        model = load_image_model(run)
        x = model.preprocess([held.load(i) for i in range(len(held))]).numpy()  # as the gate does
        s8s8 = Path(tmp) / "digits.s8s8.onnx"  # the alternative the export does not take, for its figure
        quantize_classifier(model, out, s8s8, signed_activations=True)
        sessions = {"fp32": make_session(out, threads=1), "int8": make_session(report["int8_path"], threads=1),
                    "int8_s8s8": make_session(s8s8, threads=1)}
        best = {(name, b): float("inf") for name in sessions for b in (1, 64)}
        for _ in range(args.rounds):
            for (name, b) in best:
                best[name, b] = min(best[name, b], per_image_us(sessions[name], x, b))
    for (name, b), us in best.items():
        print(f"{name} batch {b}: {us:.1f} us/image")
    keys = ("images", "top1_agreement", "fp32_top1", "int8_top1", "drop_points", "passed")
    print(json.dumps({"steps": args.steps, "image_size": args.image_size, **{k: gate[k] for k in keys},
                      "fp32_bytes": gate["fp32_bytes"], "int8_bytes": gate["int8_bytes"],
                      "size_ratio": round(gate["size_ratio"], 4),
                      "us_per_image": {f"{n}_b{b}": round(v, 1) for (n, b), v in best.items()},
                      "latency_ratio_b1": round(best["int8", 1] / best["fp32", 1], 3),
                      "latency_ratio_b64": round(best["int8", 64] / best["fp32", 64], 3),
                      "s8s8_latency_ratio_b1": round(best["int8_s8s8", 1] / best["fp32", 1], 3),
                      "s8s8_latency_ratio_b64": round(best["int8_s8s8", 64] / best["fp32", 64], 3)}))


if __name__ == "__main__":
    main()
