"""Triton kernels vs the eager reference ops on the active GPU backend (cuda or rocm).

For each op and direction (fwd, bwd): median time of the Triton kernel and of the eager reference, achieved
GB/s of the Triton kernel (minimum bytes the op must move / time), that as a fraction of the part's HBM
bandwidth (table by device name, see crosstrain.backends.cuda.specs), speedup over eager, and the max abs
difference to the reference. Prints a table, then ONE JSON line:
{"device", "min_bandwidth_fraction", "min_speedup", "results": [...]}.

The min_* figures cover the memory-bound ops (rms_norm, rotary_embedding, swiglu, cross_entropy);
linear_cross_entropy is matmul-bound, so it is reported (time, speedup, peak memory) but kept out of them.
Without a GPU it prints one line saying so and a JSON line with "skipped": true.

``--cpu`` measures the CPU backend's native kernels (``crosstrain.backends.cpu.native.kernels``) against the
same eager references instead: per op, forward and forward+backward, native and reference timed in alternating
order within each repetition (medians), with the max difference to the reference and the machine's load average;
``--gpt-step`` adds a small-preset GPT forward+backward in both kernel modes. JSON line {"device": "cpu", "isa",
"threads", "loadavg", "min_speedup", "min_speedup_fwd+bwd", "gpt_step_speedup", "results": [...]}.

    python benchmarks/kernels.py [--size full|small] [--dtype bf16|fp16|fp32] [--ops rms_norm,swiglu]
    python benchmarks/kernels.py --cpu [--size small|tiny] [--dtype fp32|bf16] [--reps 9] [--gpt-step]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _timing import alternate, seconds

from crosstrain import registry
from crosstrain.kernels import reference

MEMORY_BOUND = ("rms_norm", "rotary_embedding", "swiglu", "cross_entropy")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def shapes(size: str) -> dict[str, dict[str, int]]:
    if size == "tiny":  # --dry-run on the CPU interpreter
        return {
            "rms_norm": {"rows": 8, "width": 96},
            "rotary_embedding": {"batch": 1, "seq": 4, "heads": 3, "head_dim": 16},
            "swiglu": {"rows": 4, "width": 100},
            "cross_entropy": {"rows": 4, "vocab": 500},
            "linear_cross_entropy": {"rows": 8, "hidden": 16, "vocab": 300},
        }
    if size == "small":
        return {
            "rms_norm": {"rows": 4096, "width": 4096},
            "rotary_embedding": {"batch": 4, "seq": 1024, "heads": 32, "head_dim": 128},
            "swiglu": {"rows": 4096, "width": 11008},
            "cross_entropy": {"rows": 2048, "vocab": 128256},
            "linear_cross_entropy": {"rows": 2048, "hidden": 2048, "vocab": 32000},
        }
    return {
        "rms_norm": {"rows": 16384, "width": 4096},
        "rotary_embedding": {"batch": 8, "seq": 4096, "heads": 32, "head_dim": 128},
        "swiglu": {"rows": 16384, "width": 14336},
        "cross_entropy": {"rows": 8192, "vocab": 128256},
        "linear_cross_entropy": {"rows": 8192, "hidden": 4096, "vocab": 128256},
    }


def make_case(op: str, s: dict[str, int], dtype: torch.dtype, dev: torch.device) -> tuple[tuple, tuple[int, ...], dict]:
    """(args, indices needing grad, bytes moved per direction) for one op."""
    e = torch.tensor([], dtype=dtype).element_size()
    if op == "rms_norm":
        n = s["rows"] * s["width"]
        args = (torch.randn(s["rows"], s["width"], device=dev, dtype=dtype),
                torch.ones(s["width"], device=dev, dtype=dtype), 1e-6)
        return args, (0, 1), {"fwd": 2 * n * e, "bwd": 3 * n * e}
    if op == "rotary_embedding":
        n = s["batch"] * s["seq"] * s["heads"] * s["head_dim"]
        ang = torch.randn(s["seq"], s["head_dim"] // 2, device=dev)
        x = torch.randn(s["batch"], s["seq"], s["heads"], s["head_dim"], device=dev, dtype=dtype)
        return (x, ang.cos(), ang.sin()), (0,), {"fwd": 2 * n * e, "bwd": 2 * n * e}
    if op == "swiglu":
        n = s["rows"] * s["width"]
        args = (torch.randn(s["rows"], s["width"], device=dev, dtype=dtype),
                torch.randn(s["rows"], s["width"], device=dev, dtype=dtype))
        return args, (0, 1), {"fwd": 3 * n * e, "bwd": 5 * n * e}
    if op == "cross_entropy":
        n = s["rows"] * s["vocab"]
        logits = torch.randn(s["rows"], s["vocab"], device=dev, dtype=dtype)
        targets = torch.randint(0, s["vocab"], (s["rows"],), device=dev)
        return (logits, targets, -100), (0,), {"fwd": n * e, "bwd": 2 * n * e}
    if op == "linear_cross_entropy":
        hidden = torch.randn(s["rows"], s["hidden"], device=dev, dtype=dtype) * 0.5
        weight = torch.randn(s["vocab"], s["hidden"], device=dev, dtype=dtype) * 0.02
        targets = torch.randint(0, s["vocab"], (s["rows"],), device=dev)
        return (hidden, weight, targets, -100), (0, 1), {}
    raise ValueError(op)


def triton_impl(op: str) -> Callable[..., Any]:
    from crosstrain.backends.triton.register import TRITON_OPS, _module

    module, fn, _ = TRITON_OPS[op]
    return getattr(_module(module), fn)


def bench(fn: Callable[[], Any], dry_run: bool = False) -> float:
    """Median milliseconds (triton's do_bench: warm-up, L2 flush, CUDA events); a plain timer in a dry run."""
    if dry_run:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def measure(op: str, impl: Callable[..., Any], args: tuple, grad_idx: tuple[int, ...], dry: bool) -> dict[str, Any]:
    leaves = [a.detach().requires_grad_(i in grad_idx) if isinstance(a, torch.Tensor) else a
              for i, a in enumerate(args)]
    inputs = [leaves[i] for i in grad_idx]
    out = impl(*leaves)
    gen = torch.Generator(device=out.device).manual_seed(1)  # same upstream gradient for both implementations
    up = torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)
    result: dict[str, Any] = {"out": out.detach().float()}
    result["fwd_ms"] = bench(lambda: impl(*leaves), dry)
    result["grads"] = [g.float() for g in torch.autograd.grad(out, inputs, up, retain_graph=True)]
    result["bwd_ms"] = bench(lambda: torch.autograd.grad(out, inputs, up, retain_graph=True), dry)
    return result


def measure_fused(impl: Callable[..., Any], args: tuple, grad_idx: tuple[int, ...], dev: torch.device,
                  dry: bool) -> dict:
    """fwd+bwd together (the fused kernel computes gradients during forward), with peak memory."""
    leaves = [a.detach().requires_grad_(i in grad_idx) if isinstance(a, torch.Tensor) else a
              for i, a in enumerate(args)]
    inputs = [leaves[i] for i in grad_idx]

    def step() -> None:
        torch.autograd.grad(impl(*leaves), inputs)

    step()
    if dry:
        return {"fwd+bwd_ms": bench(step, dry), "peak_extra_bytes": 0}
    mod = torch.get_device_module(dev.type)
    mod.synchronize()
    mod.reset_peak_memory_stats()
    base = mod.memory_allocated()
    step()
    mod.synchronize()
    peak = mod.max_memory_allocated() - base
    return {"fwd+bwd_ms": bench(step), "peak_extra_bytes": int(peak)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("full", "small", "tiny"), default=None,
                        help="GPU: full (default) or small; --cpu: small (default) or tiny")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--ops", default=",".join((*MEMORY_BOUND, "linear_cross_entropy")))
    parser.add_argument("--dry-run", action="store_true",
                        help="exercise this script on the CPU under TRITON_INTERPRET=1 with tiny shapes (no figures)")
    parser.add_argument("--cpu", action="store_true", help="native CPU kernels vs the eager references")
    parser.add_argument("--reps", type=int, default=9, help="--cpu: interleaved repetitions per op")
    parser.add_argument("--gpt-step", action="store_true",
                        help="--cpu: also time a small-preset GPT forward+backward, native vs reference mode")
    args = parser.parse_args()
    if args.cpu:
        return run_cpu(args)
    args.size = args.size or "full"
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        return run(args, dry=True)

    return run(args, dry=False)


def run(args: argparse.Namespace, dry: bool) -> int:
    if dry:
        return report(args, "cpu (dry run, TRITON_INTERPRET=1)", None, None, torch.device("cpu"), dry=True)
    try:
        selection = registry.select_backend("auto")
    except Exception as exc:
        selection = None
        why = str(exc)
    backend = selection.backend if selection else None
    if backend is None or backend.name not in ("cuda", "rocm"):
        if backend is not None:
            probes = {n: r for n, _, r in selection.probes}  # type: ignore[union-attr]
            why = f"cuda: {probes.get('cuda', '?')}; rocm: {probes.get('rocm', '?')}"
        print(f"benchmarks/kernels.py: no GPU backend available here, nothing measured ({why}); --cpu measures "
              "the native CPU kernels")
        print(json.dumps({"skipped": True, "reason": why, "min_bandwidth_fraction": None, "min_speedup": None}))
        return 0
    registry.set_active_backend(backend)
    device = backend.device()
    dev = device.device_for_local_rank(0)
    device.set_device(dev)
    return report(args, device.device_name(), device.part(), backend.name, dev, dry=False)  # type: ignore[attr-defined]


def report(args: argparse.Namespace, name: str, part: Any, backend_name: str | None, dev: torch.device,
           dry: bool) -> int:
    bandwidth = part.bandwidth if part else 0.0
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)

    rows: list[dict[str, Any]] = []
    for op in [o.strip() for o in args.ops.split(",") if o.strip()]:
        case_args, grad_idx, nbytes = make_case(op, shapes("tiny" if dry else args.size)[op], dtype, dev)
        ref = reference.CORE_OPS[op][0]
        fast = triton_impl(op)
        if op == "linear_cross_entropy":
            t = measure_fused(fast, case_args, grad_idx, dev, dry)
            r = measure_fused(ref, case_args, grad_idx, dev, dry)
            rows.append({"op": op, "dir": "fwd+bwd", "triton_ms": t["fwd+bwd_ms"], "eager_ms": r["fwd+bwd_ms"],
                         "speedup": r["fwd+bwd_ms"] / t["fwd+bwd_ms"], "gbps": None, "bw_fraction": None,
                         "triton_peak_mib": t["peak_extra_bytes"] / 2**20,
                         "eager_peak_mib": r["peak_extra_bytes"] / 2**20, "max_err": None})
            continue
        t = measure(op, fast, case_args, grad_idx, dry)
        r = measure(op, ref, case_args, grad_idx, dry)
        errs = {"fwd": (t["out"] - r["out"]).abs().max().item(),
                "bwd": max((a - b).abs().max().item() for a, b in zip(t["grads"], r["grads"], strict=True))}
        for direction in ("fwd", "bwd"):
            ms_t, ms_r = t[f"{direction}_ms"], r[f"{direction}_ms"]
            gbps = nbytes[direction] / (ms_t * 1e-3) / 1e9
            rows.append({"op": op, "dir": direction, "triton_ms": ms_t, "eager_ms": ms_r, "speedup": ms_r / ms_t,
                         "gbps": gbps, "bw_fraction": gbps * 1e9 / bandwidth if bandwidth else None,
                         "max_err": errs[direction]})
        del case_args, t, r
        if not dry:
            torch.get_device_module(dev.type).empty_cache()

    print(f"device: {name} ({part.name if part else 'unknown part: no bandwidth figure'}), backend {backend_name}, "
          f"dtype {args.dtype}, size {'tiny' if dry else args.size}")
    header = (f"{'op':<22}{'dir':<9}{'triton ms':>10}{'eager ms':>10}{'speedup':>9}{'GB/s':>9}{'of HBM':>8}"
              f"{'max err':>10}")
    print(header)
    print("-" * len(header))
    for row in rows:
        gbps = f"{row['gbps']:.0f}" if row["gbps"] is not None else "-"
        frac = f"{row['bw_fraction']:.0%}" if row["bw_fraction"] is not None else "-"
        err = f"{row['max_err']:.2e}" if row["max_err"] is not None else "-"
        print(f"{row['op']:<22}{row['dir']:<9}{row['triton_ms']:>10.3f}{row['eager_ms']:>10.3f}"
              f"{row['speedup']:>8.2f}x{gbps:>9}{frac:>8}{err:>10}")
        if "triton_peak_mib" in row:
            print(f"{'':<31}peak extra memory: triton {row['triton_peak_mib']:.0f} MiB, "
                  f"eager {row['eager_peak_mib']:.0f} MiB")
    mem = [r for r in rows if r["op"] in MEMORY_BOUND]
    fractions = [r["bw_fraction"] for r in mem if r["bw_fraction"] is not None]
    summary = {
        "device": name,
        "part": part.name if part else None,
        "backend": backend_name,
        "dry_run": dry,
        "dtype": args.dtype,
        "size": "tiny" if dry else args.size,
        "min_bandwidth_fraction": round(min(fractions), 4) if fractions else None,
        "min_speedup": round(min(r["speedup"] for r in mem), 4) if mem else None,
        "results": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
    }
    print(json.dumps(summary))
    return 0


# -- the CPU backend's native kernels ----------------------------------------------------------------------------
def cpu_shapes(size: str) -> dict[str, dict[str, int]]:
    """The 100m preset's per-rank shapes at batch 4 x 512 (head dim 64, vocab 32000), and a tiny smoke size."""
    if size == "tiny":
        return shapes("tiny")
    return {
        "rms_norm": {"rows": 2048, "width": 768},
        "rotary_embedding": {"batch": 4, "seq": 512, "heads": 12, "head_dim": 64},
        "swiglu": {"rows": 2048, "width": 2048},
        "cross_entropy": {"rows": 512, "vocab": 32000},
        "linear_cross_entropy": {"rows": 512, "hidden": 256, "vocab": 32000},
    }


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def interleaved_ms(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median milliseconds of each function, all timed in every repetition (order alternating), after a warm-up."""
    for fn in fns.values():
        fn()
    times = alternate(list(fns), reps, lambda name, _: seconds(fns[name]) * 1e3)
    return {name: _median(ts) for name, ts in times.items()}


def _cpu_case(fn: Callable[..., Any], args: tuple, grad_idx: tuple[int, ...]) -> dict[str, Any]:
    leaves = [a.detach().clone().requires_grad_(i in grad_idx) if isinstance(a, torch.Tensor) else a
              for i, a in enumerate(args)]
    inputs = [leaves[i] for i in grad_idx]
    out = fn(*leaves)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad(out, inputs, up)
    return {"fwd": lambda: fn(*leaves),
            "fwd+bwd": lambda: torch.autograd.grad(fn(*leaves), inputs, up),
            "out": out.detach().float(), "grads": [g.float() for g in grads]}


def gpt_step_row(size: str, dtype: torch.dtype, reps: int) -> dict[str, Any]:
    """Forward+backward of the ``small`` GPT preset (batch 8 x 256, byte vocabulary) with the native kernels vs
    ``kernels = "reference"``: what the ops above add up to inside a model (the GEMMs and attention are torch's)."""
    from crosstrain.kernels import registry as kernel_registry
    from crosstrain.models.gpt import GPT, PRESETS
    from crosstrain.recipes.lm import next_token_loss

    registry.set_active_backend("cpu")
    torch.manual_seed(0)
    batch, seq = (2, 32) if size == "tiny" else (8, 256)
    model = GPT(PRESETS["small"]).to(dtype)
    data = torch.randint(0, model.config.vocab_size, (batch, seq + 1))
    losses: dict[str, float] = {}

    def step(mode: str) -> Callable[[], None]:
        def run() -> None:
            kernel_registry.set_mode(mode)
            try:
                loss = next_token_loss(model(data[:, :-1]), data[:, 1:])
                loss.backward()
                losses[mode] = loss.item()
            finally:
                kernel_registry.set_mode("auto")
                model.zero_grad(set_to_none=True)
        return run

    ms = interleaved_ms({"native": step("auto"), "reference": step("reference")}, reps)
    return {"op": "gpt_small_step", "dir": "fwd+bwd", "native_ms": ms["native"], "reference_ms": ms["reference"],
            "speedup": ms["reference"] / ms["native"], "max_err": abs(losses["auto"] - losses["reference"])}


def run_cpu(args: argparse.Namespace) -> int:
    from crosstrain.backends.cpu.native import kernels as native

    size = args.size or "small"
    if not native.available():
        why = native._IMPORT_ERROR
        print(f"benchmarks/kernels.py --cpu: the native CPU kernels are not built ({why}), nothing measured")
        print(json.dumps({"device": "cpu", "skipped": True, "reason": why, "min_speedup": None}))
        return 0
    if args.dtype not in ("fp32", "bf16"):
        print(f"benchmarks/kernels.py --cpu: --dtype {args.dtype} is not a native CPU dtype; use fp32 or bf16",
              file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    for op in [o.strip() for o in args.ops.split(",") if o.strip()]:
        case_args, grad_idx, _ = make_case(op, cpu_shapes(size)[op], dtype, torch.device("cpu"))
        nat = _cpu_case(native.OPS[op][0], case_args, grad_idx)
        ref = _cpu_case(reference.CORE_OPS[op][0], case_args, grad_idx)
        errs = {"fwd": (nat["out"] - ref["out"]).abs().max().item(),
                "fwd+bwd": max((a - b).abs().max().item() for a, b in zip(nat["grads"], ref["grads"], strict=True))}
        for direction in ("fwd", "fwd+bwd"):
            ms = interleaved_ms({"native": nat[direction], "reference": ref[direction]}, args.reps)
            rows.append({"op": op, "dir": direction, "native_ms": ms["native"], "reference_ms": ms["reference"],
                         "speedup": ms["reference"] / ms["native"], "max_err": errs[direction]})
    if args.gpt_step:
        rows.append(gpt_step_row(size, dtype, args.reps))
    load_after = os.getloadavg()
    print(f"device: cpu, native kernels {native.isa()}, {torch.get_num_threads()} threads, dtype {args.dtype}, "
          f"size {size}, {args.reps} interleaved reps, loadavg {load_before[0]:.2f} -> {load_after[0]:.2f}")
    header = f"{'op':<22}{'dir':<9}{'native ms':>10}{'ref ms':>10}{'speedup':>9}{'max err':>10}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['op']:<22}{row['dir']:<9}{row['native_ms']:>10.3f}{row['reference_ms']:>10.3f}"
              f"{row['speedup']:>8.2f}x{row['max_err']:>10.2e}")
    op_rows = [r for r in rows if r["op"] in native.OPS]
    summary = {
        "device": "cpu", "isa": native.isa(), "threads": torch.get_num_threads(), "dtype": args.dtype, "size": size,
        "reps": args.reps, "loadavg": [round(load_before[0], 2), round(load_after[0], 2)],
        "min_speedup": round(min(r["speedup"] for r in op_rows), 4) if op_rows else None,
        "min_speedup_fwd+bwd": round(min(r["speedup"] for r in op_rows if r["dir"] == "fwd+bwd"), 4)
        if op_rows else None,
        "gpt_step_speedup": round(rows[-1]["speedup"], 4) if args.gpt_step else None,
        "results": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
