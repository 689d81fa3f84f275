"""``crosstrain export`` of a ``--recipe detect`` run, then the ONNX file on the whole held-out split.

Trains (unless ``--run`` names a finished run) the detect defaults for ``--steps`` steps on the embedded shapes,
exports with ``crosstrain export RUN --json`` (the parity gate's figures), then feeds every held-out image, as the
recipe's evaluation feeds it (longer side ``detect.eval_size``), to onnxruntime one image at a time and scores
the detections with the recipe's own pycocotools ``coco_map``: the ONNX file's COCO ``map`` / ``map_50`` beside
the run's last ``eval/map`` / ``eval/map_50``. Also the per-image latency of onnxruntime and of PyTorch eager at
one thread (the best of 3 interleaved rounds; a benchmark figure).

Last line JSON.

    python benchmarks/vision_detect_onnx.py [--steps 300] [--model fcos_resnet18_fpn] [--work DIR] [--run RUN]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--model", default="fcos_resnet18_fpn")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--run", type=Path, default=None, help="a finished detect run (skips training)")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="detect_onnx_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "crosstrain"]
    run = args.run
    train_s = 0.0
    if run is None:
        run = work / "run"
        sets = [f"detect.model={args.model}", f"train.steps={args.steps}", f"eval.every={args.steps}",
                "checkpoint.every=0", "checkpoint.final=true", "logging.progress=none", "backend=cpu",
                f"detect.shapes_dir={work / 'shapes'}"]
        t0 = time.perf_counter()
        subprocess.run([*cli, "train", "--recipe", "detect", "--run-dir", str(run),
                        *[x for s in sets for x in ("--set", s)]], check=True, env=env)
        train_s = time.perf_counter() - t0
    out = work / "detector.onnx"
    t0 = time.perf_counter()
    exported = subprocess.run([*cli, "export", str(run), "--out", str(out), "--json"], check=True, env=env,
                              capture_output=True, text=True)
    export_s = time.perf_counter() - t0
    report = json.loads(exported.stdout.strip().splitlines()[-1])

    import numpy as np
    import torch

    torch.set_num_threads(1)
    from crosstrain.engine.recipe import resolve_recipe
    from crosstrain.plugins.export.runtime import make_session
    from crosstrain.plugins.vision.detect.data import DetectDataset
    from crosstrain.plugins.vision.detect.metrics import coco_map, to_coco_results
    from crosstrain.plugins.vision.load import load_image_model

    model = load_image_model(run)
    recipe = resolve_recipe("detect")
    recipe.validate(model.config)
    recipe._load(model.config)
    size = model.shape[1]
    held = DetectDataset(recipe.val_samples, sizes=[size], seed=0)
    batch = held.batch(np.arange(len(held)))
    session = make_session(out, threads=1)
    dets = []
    for img in batch.images:
        boxes, scores, labels = session.run(None, {"images": img[None].numpy()})
        dets.append({"boxes": torch.from_numpy(boxes), "scores": torch.from_numpy(scores),
                     "labels": torch.from_numpy(labels)})
    onnx_map = coco_map(recipe.val_samples.coco, to_coco_results(batch.image_ids, batch.scales, dets),
                        batch.image_ids.tolist())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last_eval = next(r for r in reversed(rows) if "eval/map" in r)

    best = {"onnxruntime": float("inf"), "torch": float("inf")}
    sample = batch.images[:32]
    for _ in range(3):
        t0 = time.perf_counter()
        for img in sample:
            session.run(None, {"images": img[None].numpy()})
        best["onnxruntime"] = min(best["onnxruntime"], (time.perf_counter() - t0) / len(sample))
        t0 = time.perf_counter()
        with torch.no_grad():
            for img in sample:
                model.model([img])
        best["torch"] = min(best["torch"], (time.perf_counter() - t0) / len(sample))
    print(json.dumps({
        "model": model.config.section("detect").model, "step": model.step, "held_out_images": len(held),
        "eval_map": last_eval["eval/map"], "eval_map_50": last_eval["eval/map_50"],
        "onnx_map": onnx_map["map"], "onnx_map_50": onnx_map["map_50"],
        "map_diff": onnx_map["map"] - last_eval["eval/map"],
        "map_50_diff": onnx_map["map_50"] - last_eval["eval/map_50"],
        "parity": report["parity"], "onnx_bytes": out.stat().st_size,
        "onnxruntime_ms_per_image": best["onnxruntime"] * 1e3, "torch_ms_per_image": best["torch"] * 1e3,
        "train_s": round(train_s, 1), "export_s": round(export_s, 1)}))


if __name__ == "__main__":
    main()
