"""Integer ONNX exports against the fp32 export, side by side in one run: per-token decode time and model bytes.

For each preset (random weights, seed 0) the model is exported three ways with crosstrain's exporters, each through
its own parity gate: ``fp32`` (``crosstrain export``), ``int8`` (``--ptq int8``: int8 weights per output channel,
``DynamicQuantizeLinear`` + ``MatMulInteger``) and ``int4`` (``--ptq int8-act-int4-weight``, group 32: int4 weights
through ``MatMulNBits`` at ``accuracy_level=4``); both integer exports store the token embedding in int8 (one scale
per row) and a tied head computes with it (``MatMulNBits``, 8 bits). Then onnxruntime, 1 intra-op thread, batch 1:
one decode step (one token in, a past of ``--past`` tokens), the three sessions alternating in rounds (ABBA), the
median round kept. ``bytes_*`` = .onnx file bytes / the fp32 file's (without the exporter's per-node debug records,
which the integer exports strip).

    python benchmarks/quant_export.py --quick     # presets small,100m; last line: JSON
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _timing import alternate, seconds

KINDS = ("fp32", "int8", "int4")
SCHEMES = {"int8": "int8", "int4": "int8-act-int4-weight"}


def _stripped_bytes(path: Path) -> int:
    """Bytes of ``path`` saved without the exporter's per-node debug records (as the integer exports are)."""
    import onnx

    model = onnx.load(str(path))
    for node in model.graph.node:
        del node.metadata_props[:]
    return len(model.SerializeToString())


def export_all(preset: str, root: Path) -> dict[str, Any]:
    """The three exports of a random ``preset`` model, with their parity reports and export seconds."""
    from crosstrain.models.gpt import build_gpt
    from crosstrain.plugins.compress.qat.export import export_quantized_onnx
    from crosstrain.plugins.compress.qat.schemes import scheme
    from crosstrain.plugins.export.loading import LoadedModel, tokenizer_metadata
    from crosstrain.plugins.export.onnx_export import export_onnx

    torch.manual_seed(0)
    model = build_gpt(preset).eval()
    cfg = model.config
    out: dict[str, Any] = {"preset": preset, "params": model.num_params(), "tie_embeddings": cfg.tie_embeddings}
    t0 = time.perf_counter()
    report = export_onnx(LoadedModel(model, cfg, tokenizer_metadata(cfg), f"random {preset}"), root / "fp32.onnx")
    out["fp32"] = {"export_s": time.perf_counter() - t0, "parity": report.parity.to_dict(),
                   "bytes": _stripped_bytes(root / "fp32.onnx")}
    for kind, name in SCHEMES.items():
        loaded = LoadedModel(copy.deepcopy(model), cfg, tokenizer_metadata(cfg), f"random {preset}")
        t0 = time.perf_counter()
        q = export_quantized_onnx(loaded, root / f"{kind}.onnx", scheme(name, 32), ptq=True)
        out[kind] = {"export_s": time.perf_counter() - t0, "parity": q.parity.to_dict(),
                     "bytes": (root / f"{kind}.onnx").stat().st_size, "integer_matmuls": q.layers}
    return out


def time_decode(root: Path, past: int, rounds: int, iters: int) -> dict[str, float]:
    """Median over rounds of the seconds of one decode step per session (1 thread)."""
    from crosstrain.plugins.export.generate import OrtEngine

    engines = {k: OrtEngine(root / f"{k}.onnx", threads=1) for k in KINDS}
    cfg = engines["fp32"].config
    rng = np.random.default_rng(0)
    cache = [rng.standard_normal((1, cfg.kv_heads, past, cfg.head_dim)).astype(np.float32)
             for _ in range(2 * cfg.n_layers)]
    ids = rng.integers(0, cfg.vocab_size, (1, 1))
    fns = {k: (lambda e=e: e.forward(ids, cache)) for k, e in engines.items()}
    for fn in fns.values():  # warm-up
        fn()
        fn()
    samples = alternate(list(fns), rounds, lambda name, _: seconds(fns[name], iters))
    return {k: statistics.median(v) for k, v in samples.items()}


def bench(preset: str, past: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"crosstrain-bench-quant-{preset}-") as tmp:
        root = Path(tmp)
        out = export_all(preset, root)
        big = out["params"] > 20_000_000
        times = time_decode(root, past, rounds, iters=10 if big else 200)
    for kind in KINDS:
        out[kind]["decode_ms"] = times[kind] * 1e3
    for kind in ("int8", "int4"):
        out[f"{kind}_time_ratio"] = times[kind] / times["fp32"]
        out[f"{kind}_bytes_ratio"] = out[kind]["bytes"] / out["fp32"]["bytes"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="presets small,100m, 5 rounds")
    ap.add_argument("--presets", default="small,100m")
    ap.add_argument("--rounds", type=int, default=None, help="default: 5 with --quick, else 9")
    ap.add_argument("--past", type=int, default=32, help="tokens already in the KV cache at the timed step")
    args = ap.parse_args()
    rounds = args.rounds or (5 if args.quick else 9)
    import onnxruntime

    results = {}
    for preset in args.presets.split(","):
        r = bench(preset.strip(), args.past, rounds)
        results[r["preset"]] = r
        print(f"{r['preset']:6s} decode ms fp32 {r['fp32']['decode_ms']:.3f}  int8 {r['int8']['decode_ms']:.3f} "
              f"({r['int8_time_ratio']:.3f}x)  int4 {r['int4']['decode_ms']:.3f} ({r['int4_time_ratio']:.3f}x)  "
              f"bytes int8 {r['int8_bytes_ratio']:.3f}x int4 {r['int4_bytes_ratio']:.3f}x  parity int8 "
              f"{r['int8']['parity']['max_abs_err']:.3g} <= {r['int8']['parity']['tolerance']:.3g}, int4 "
              f"{r['int4']['parity']['max_abs_err']:.3g} <= {r['int4']['parity']['tolerance']:.3g}", flush=True)
    summary: dict[str, Any] = {"threads": 1, "past": args.past, "rounds": rounds,
                               "onnxruntime": onnxruntime.__version__, "quantized": "every linear layer (int8: "
                               "per output channel; int4: group 32), the token embedding in int8 per row, a tied "
                               "head with it"}
    for preset, r in results.items():
        for key in ("int8_time_ratio", "int4_time_ratio", "int8_bytes_ratio", "int4_bytes_ratio"):
            summary[f"{key}_{preset}"] = r[key]
        summary[f"parity_passed_{preset}"] = all(r[k]["parity"]["passed"] for k in KINDS)
    if "100m" in results:
        r = results["100m"]
        summary["targets_met_100m"] = bool(r["int8_time_ratio"] <= 0.6 and r["int4_time_ratio"] <= 0.8
                                           and r["int8_bytes_ratio"] <= 0.3 and r["int4_bytes_ratio"] <= 0.2)
    summary["raw"] = results
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
