"""Whole training runs on a GPU backend next to the CPU reference: the check that the engine, not only the
kernels, runs on the device (``scripts/gpu_check.sh`` calls it on a lent GPU machine).

Each run is a real ``python -m crosstrain train`` subprocess with its own run dir:
  1. ``cpu``, fp32, ``kernels.mode=reference``: the reference losses.
  2. the GPU backend, fp32, ``kernels.mode=reference``: same math on the device; the largest relative loss
     difference to (1) over every step is ``fp32_reference_rel``.
  3. the GPU backend, fp32, ``kernels.mode=auto`` (Triton kernels where registered): ``fp32_kernels_rel``.
  4. the GPU backend, bf16, preset ``--preset`` (default ``100m``), longer sequences: steady tokens/s, MFU,
     compile seconds and peak memory as summary.json reports them; ``parallel.compile=auto`` (the default).
  5. the same with ``parallel.compile=true``: what compiling costs and saves on the device.
Prints one line per run, then ONE JSON line with every figure.

    python benchmarks/gpu_train.py [--backend cuda] [--steps 30] [--preset 100m] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

COMMON = ["--set", "checkpoint.every=0", "--set", "checkpoint.every_minutes=0", "--set", "eval.every=0"]


def train(run_dir: str, backend: str, steps: int, *sets: str) -> dict[str, Any]:
    """One ``crosstrain train`` subprocess; its summary.json, plus ``wall_s`` and ``rc`` (and ``stderr`` on failure)."""
    cmd = [sys.executable, "-m", "crosstrain", "train", "--run-dir", run_dir, "--set", f"backend={backend}",
           "--set", f"train.steps={steps}", *COMMON]
    for s in sets:
        cmd += ["--set", s]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out: dict[str, Any] = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - start, 1)}
    path = os.path.join(run_dir, "summary.json")
    if proc.returncode == 0 and os.path.exists(path):
        with open(path) as fh:
            out.update(json.load(fh))
    else:
        out["stderr"] = proc.stderr[-2000:]
    return out


def max_rel(a: list[float], b: list[float]) -> float | None:
    if not a or len(a) != len(b):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def brief(name: str, s: dict[str, Any]) -> dict[str, Any]:
    keys = ("rc", "wall_s", "initial_loss", "final_loss", "tokens_per_s", "mfu", "peak_memory_bytes", "compile_s",
            "params_sha256", "precision")
    row = {k: s.get(k) for k in keys if k in s}
    if "compile" in s.get("defaults", {}):
        row["compile"] = s["defaults"]["compile"]
    print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in row.items()) + (f"\n{s['stderr']}" if "stderr" in s else ""),
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="gpu_train_")
    runs = {
        "cpu_fp32_reference": train(f"{root}/cpu", "cpu", args.steps, "kernels.mode=reference",
                                    "parallel.compile=false"),
        "gpu_fp32_reference": train(f"{root}/gpu_ref", args.backend, args.steps, "kernels.mode=reference",
                                    "parallel.compile=false"),
        "gpu_fp32_kernels": train(f"{root}/gpu_kern", args.backend, args.steps, "kernels.mode=auto",
                                  "parallel.compile=false"),
        "gpu_bf16_large": train(f"{root}/gpu_bf16", args.backend, args.steps, f"model.preset={args.preset}",
                                "precision.dtype=bf16", "train.seq_len=1024", "model.max_seq_len=1024",
                                "train.batch_size=32"),
        "gpu_bf16_large_compiled": train(f"{root}/gpu_bf16c", args.backend, args.steps, f"model.preset={args.preset}",
                                         "precision.dtype=bf16", "train.seq_len=1024", "model.max_seq_len=1024",
                                         "train.batch_size=32", "parallel.compile=true"),
    }
    rows = {name: brief(name, s) for name, s in runs.items()}
    ref = runs["cpu_fp32_reference"].get("losses", [])
    result = {
        "backend": args.backend,
        "steps": args.steps,
        "fp32_reference_rel": max_rel(runs["gpu_fp32_reference"].get("losses", []), ref),
        "fp32_kernels_rel": max_rel(runs["gpu_fp32_kernels"].get("losses", []), ref),
        "runs": rows,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
