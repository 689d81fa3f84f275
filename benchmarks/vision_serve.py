"""A default ``--recipe classify`` run on the embedded digits, deployed: ``crosstrain eval --predictions`` vs
``crosstrain serve`` (a real process; every held-out digit sent as PNG in base64 JSON over HTTP) vs ``crosstrain
export`` (its parity gate). All through the ``crosstrain`` command, as a user runs them.

Last line: JSON with ``eval_top1`` (metrics.jsonl), ``eval_correct`` and ``serve_correct`` (of 368),
``serve_equal_eval`` (images where the server's top-1 is eval's), ``latency_ms_per_92`` (median of the four
92-image requests) and the export's ``parity``.

    python benchmarks/vision_serve.py [--steps 400]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    import httpx
    from PIL import Image

    from crosstrain.plugins.vision.data.sources import digits

    cli = [sys.executable, "-m", "crosstrain"]
    with tempfile.TemporaryDirectory(prefix="vision-serve-") as tmp:
        run, preds, onnx = Path(tmp) / "run", Path(tmp) / "pred.jsonl", Path(tmp) / "digits.onnx"
        subprocess.run([*cli, "train", "--recipe", "classify", "--run-dir", str(run), "--set", "logging.progress=none",
                        "--set", f"train.steps={args.steps}", "--set", "eval.max_batches=0", "--set",
                        f"eval.every={args.steps}", "--set", f"checkpoint.every={args.steps}"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run([*cli, "eval", str(run), "--set", "eval.max_batches=0", "--predictions", str(preds)],
                       check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in preds.read_text().splitlines()]
        _, held = digits()
        files = []
        for i in range(len(held)):
            buf = io.BytesIO()
            Image.fromarray(held.load(i)[0].numpy()).save(buf, format="PNG")
            files.append(base64.b64encode(buf.getvalue()).decode())
        server = subprocess.Popen([*cli, "serve", str(run), "--port", "0"], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        try:
            assert server.stdout is not None
            found = re.search(r"http://127\.0\.0\.1:\d+", server.stdout.readline())
            assert found, "the server printed no listening line"
            got, times = [], []
            with httpx.Client(base_url=found.group(0), timeout=120) as client:
                for start in range(0, len(files), 92):
                    t0 = time.perf_counter()
                    reply = client.post("/v1/images/classify", json={"images": files[start:start + 92]})
                    times.append((time.perf_counter() - t0) * 1000)
                    got += [r["top_k"][0]["label"] for r in reply.json()["data"]]
        finally:
            server.terminate()
            server.wait()
        out = subprocess.run([*cli, "export", str(run), "--out", str(onnx), "--json"], check=True,
                             capture_output=True, text=True).stdout
        parity = json.loads(out.strip().splitlines()[-1])["parity"]
        top1 = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]["eval/top1"]
    labels = held.labels.tolist()
    print(json.dumps({"steps": args.steps, "eval_top1": top1, "images": len(got),
                      "eval_correct": sum(r["pred"] == r["label"] for r in rows),
                      "serve_correct": sum(g == y for g, y in zip(got, labels, strict=True)),
                      "serve_equal_eval": sum(g == r["pred"] for g, r in zip(got, rows, strict=True)),
                      "latency_ms_per_92": statistics.median(times), "parity": parity}))


if __name__ == "__main__":
    main()
