"""Inference after export: onnxruntime (fp32 and int8) vs PyTorch eager, with the same KV cache, one CPU thread.

For each preset (random weights; ``tiny`` gets ``max_seq_len=1024`` so a 512-token past fits) the model is
exported with crosstrain's exporter (parity-checked), quantized to int8, and then timed side by side:

* decode: per-token latency at batch 1 with a past of 32 and of 512 tokens (one token in, logits + cache out);
* prefill: prompt tokens per second for a batch-1 prompt with an empty cache.

Engines run in alternating rounds (eager, ort fp32, ort int8, ...) and the median round is kept, so machine
noise hits all of them alike. torch.set_num_threads(1) and ORT intra_op_num_threads=1. Last line: one JSON object
with ``decode_latency_ratio`` (ort fp32 / eager, tiny, past 32), ``decode_latency_ratio_large`` (same, 100m)
and the other figures.

    python benchmarks/export.py [--presets tiny,100m] [--rounds 5] [--prefill-len 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _timing import alternate, seconds

from crosstrain.models.gpt import build_gpt
from crosstrain.plugins.export.generate import OrtEngine, TorchEngine
from crosstrain.plugins.export.loading import LoadedModel, tokenizer_metadata
from crosstrain.plugins.export.onnx_export import export_onnx, int8_path_for

PASTS = (32, 512)


def _time_rounds(fns: dict[str, Any], iters: int, rounds: int) -> dict[str, float]:
    """Median over rounds of the mean seconds per call, engines alternating inside each round."""
    for fn in fns.values():  # warm-up
        fn()
        fn()
    samples = alternate(list(fns), rounds, lambda name, _: seconds(fns[name], iters))
    return {k: statistics.median(v) for k, v in samples.items()}


def _step_fns(engines: dict[str, Any], ids: np.ndarray, torch_cache: Any, np_cache: Any) -> dict[str, Any]:
    """One forward per engine on the same tokens and the same cache contents."""
    ids_t = torch.from_numpy(ids)
    return {"eager": lambda: engines["eager"].forward_torch(ids_t, torch_cache),
            "ort_fp32": lambda: engines["ort_fp32"].forward(ids, np_cache),
            "ort_int8": lambda: engines["ort_int8"].forward(ids, np_cache)}


def bench_preset(preset: str, workdir: Path, rounds: int, prefill_len: int) -> dict[str, Any]:
    torch.manual_seed(0)
    overrides = {"max_seq_len": 1024} if preset == "tiny" else {}
    model = build_gpt(preset, **overrides).eval()
    cfg = model.config
    loaded = LoadedModel(model, cfg, tokenizer_metadata(cfg), f"random {preset}")
    t0 = time.perf_counter()
    report = export_onnx(loaded, workdir / f"{preset}.onnx", int8=True, int8_tolerance=10.0)
    export_s = time.perf_counter() - t0
    engines = {"eager": TorchEngine(model), "ort_fp32": OrtEngine(report.path, threads=1),
               "ort_int8": OrtEngine(int8_path_for(Path(report.path)), threads=1)}
    big = model.num_params() > 20_000_000
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"preset": preset, "params": model.num_params(), "export_s": export_s,
                           "parity_fp32": report.parity.max_abs_err,
                           "parity_int8": report.int8_parity.max_abs_err if report.int8_parity else None}
    for past_len in PASTS:
        past = [torch.randn(1, cfg.kv_heads, past_len, cfg.head_dim) for _ in range(2 * cfg.n_layers)]
        torch_cache = [(past[2 * i], past[2 * i + 1]) for i in range(cfg.n_layers)]
        np_cache = [t.numpy() for t in past]
        ids = rng.integers(0, cfg.vocab_size, (1, 1))
        fns = _step_fns(engines, ids, torch_cache, np_cache)
        times = _time_rounds(fns, iters=5 if big else 100, rounds=rounds)
        for name, sec in times.items():
            out[f"decode_ms_p{past_len}_{name}"] = sec * 1e3
    prompt = rng.integers(0, cfg.vocab_size, (1, prefill_len))
    fns = _step_fns(engines, prompt, None, engines["ort_fp32"].empty_cache(1))
    times = _time_rounds(fns, iters=1 if big else 20, rounds=max(3, rounds // 2) if big else rounds)
    for name, sec in times.items():
        out[f"prefill_tok_s_{name}"] = prefill_len / sec
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,100m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill-len", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="crosstrain-bench-export-") as tmp:
        for preset in args.presets.split(","):
            results.append(bench_preset(preset.strip(), Path(tmp), args.rounds, args.prefill_len))
    print(f"{'preset':8s} {'metric':22s} {'eager':>10s} {'ort fp32':>10s} {'ort int8':>10s} {'fp32/eager':>10s} "
          f"{'int8/fp32':>10s}")
    for r in results:
        for past_len in PASTS:
            e, f, q = (r[f"decode_ms_p{past_len}_{n}"] for n in ("eager", "ort_fp32", "ort_int8"))
            print(f"{r['preset']:8s} {f'decode ms, past {past_len}':22s} {e:10.3f} {f:10.3f} {q:10.3f} {f / e:10.3f} "
                  f"{q / f:10.3f}")
        e, f, q = (r[f"prefill_tok_s_{n}"] for n in ("eager", "ort_fp32", "ort_int8"))
        print(f"{r['preset']:8s} {f'prefill tok/s, {args.prefill_len}':22s} {e:10.1f} {f:10.1f} {q:10.1f} "
              f"{e / f:10.3f} {f / q:10.3f}")
        print(f"{r['preset']:8s} params {r['params']:,}, export {r['export_s']:.1f}s, parity fp32 "
              f"{r['parity_fp32']:.2e}, int8 {r['parity_int8']:.2e}")
    summary: dict[str, Any] = {"threads": 1, "prefill_len": args.prefill_len}
    by = {r["preset"]: r for r in results}
    for preset, suffix in (("tiny", ""), ("100m", "_large")):
        if preset not in by:
            continue
        r = by[preset]
        summary[f"decode_latency_ratio{suffix}"] = r["decode_ms_p32_ort_fp32"] / r["decode_ms_p32_eager"]
        summary[f"decode_latency_ratio{suffix}_p512"] = r["decode_ms_p512_ort_fp32"] / r["decode_ms_p512_eager"]
        summary[f"int8_over_fp32_decode{suffix}"] = r["decode_ms_p32_ort_int8"] / r["decode_ms_p32_ort_fp32"]
        summary[f"int8_over_fp32_decode{suffix}_p512"] = r["decode_ms_p512_ort_int8"] / r["decode_ms_p512_ort_fp32"]
        summary[f"prefill_speedup{suffix}"] = r["prefill_tok_s_ort_fp32"] / r["prefill_tok_s_eager"]
        summary[f"prefill_speedup_int8{suffix}"] = r["prefill_tok_s_ort_int8"] / r["prefill_tok_s_eager"]
        summary[f"parity_fp32{suffix}"] = r["parity_fp32"]
        summary[f"parity_int8{suffix}"] = r["parity_int8"]
        summary[f"raw{suffix}"] = {k: v for k, v in r.items() if k.startswith(("decode_ms", "prefill_tok"))}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
