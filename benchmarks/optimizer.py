"""Fused mixed-precision AdamW step on the CPU: crosstrain's native kernel vs torch, side by side.

Workload (ZeRO-Offload style): N fp32 master params with fp32 exp_avg / exp_avg_sq, bf16 gradients in, bf16
parameters out. Compared in one run:

* ``crosstrain``     - ``crosstrain.backends.cpu.native.adamw_step``: one fused pass (bf16 in, bf16 out);
* ``torch fused``    - ``grad.float()`` + ``torch.optim.AdamW(fused=True).step()`` + ``param_bf16.copy_(master)``;
* ``torch foreach``  - the same casts around ``torch.optim.AdamW(foreach=True).step()``;
* ``memcpy``         - the machine's copy bandwidth (torch ``copy_`` and the extension's parallel memcpy),
  counted as bytes read + written, like the optimizer's; ``bandwidth_fraction`` divides by the better one;
* ``in-place +=``    - a read-modify-write stream (torch ``add_``), the optimizer's own access pattern, shown
  as a second yardstick (``bandwidth_fraction_vs_inplace_stream``).

Effective bandwidth counts the bytes the step must move: read 4+2+4+4, write 4+4+4+2 = 28 bytes per param.
The variants run round-robin (one of each per round) so they see the same machine load; the table gives
the best and the median round. The last line is one JSON object (best rounds) with
``speedup_vs_torch_fused`` and ``bandwidth_fraction``.

    python benchmarks/optimizer.py [--numel 100000000] [--rounds 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
from _timing import seconds

from crosstrain.backends.cpu import native

BYTES_PER_PARAM = 28  # read master, bf16 grad, exp_avg, exp_avg_sq; write master, moments, bf16 param
HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def make_variants(n: int) -> dict[str, tuple[Callable[[], None], int]]:
    """name -> (one step, bytes it is credited with)."""
    master, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    grad16 = torch.randn(n).to(torch.bfloat16)
    out16 = torch.empty(n, dtype=torch.bfloat16)
    step = [0]

    def crosstrain_step() -> None:
        step[0] += 1
        native.adamw_step(master, grad16, m, v, None, out16, step=step[0], **HYPER)

    shared = torch.nn.Parameter(torch.randn(n))  # torch's two variants share the master, not the states
    param16 = torch.empty(n, dtype=torch.bfloat16)

    def torch_step(mode: str) -> Callable[[], None]:
        opt = torch.optim.AdamW([shared], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                                weight_decay=HYPER["weight_decay"], **{mode: True})

        def run() -> None:
            shared.grad = grad16.float()  # torch's optimizers take grads in the param dtype
            opt.step()
            with torch.no_grad():
                param16.copy_(shared)  # the low-precision copy for the device
            shared.grad = None

        return run

    src, dst = torch.rand(n), torch.zeros(n)
    copy_bytes = 2 * 4 * n
    return {
        "crosstrain fused (bf16 in/out)": (crosstrain_step, BYTES_PER_PARAM * n),
        "torch AdamW fused + casts": (torch_step("fused"), BYTES_PER_PARAM * n),
        "torch AdamW foreach + casts": (torch_step("foreach"), BYTES_PER_PARAM * n),
        "memcpy (torch copy_)": (lambda: dst.copy_(src), copy_bytes),
        "memcpy (native)": (lambda: native.copy_(dst, src), copy_bytes),
        "in-place dst += 1 (torch)": (lambda: dst.add_(1.0), copy_bytes),  # read-modify-write stream
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="0 = torch.get_num_threads()")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    native.load()
    n = args.numel
    variants = make_variants(n)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn, _ in variants.values():  # warm up: page faults, lazy optimizer state
        fn()
    for _ in range(args.rounds):
        for name, (fn, _) in variants.items():
            times[name].append(seconds(fn))
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    ours = "crosstrain fused (bf16 in/out)"
    print(f"AdamW step, {n / 1e6:g}M params, fp32 master+states, bf16 grads in, bf16 params out; "
          f"{torch.get_num_threads()} threads, ISA {native.isa()}, {args.rounds} rounds")
    header = ("variant", "best ms", "median ms", "GB/s best", "GB/s median", "time/ours")
    print(f"{header[0]:32s} {header[1]:>9s} {header[2]:>10s} {header[3]:>10s} {header[4]:>12s} {header[5]:>10s}")
    for name, (_, nbytes) in variants.items():
        ratio = f"{best[name] / best[ours]:9.2f}x" if name.startswith(("crosstrain", "torch AdamW")) else ""
        print(f"{name:32s} {best[name] * 1e3:9.1f} {med[name] * 1e3:10.1f} {nbytes / best[name] / 1e9:10.2f} "
              f"{nbytes / med[name] / 1e9:12.2f} {ratio:>10s}")
    copy_bw = max(variants[k][1] / best[k] for k in variants if k.startswith("memcpy"))
    stream_bw = variants["in-place dst += 1 (torch)"][1] / best["in-place dst += 1 (torch)"]
    eff = variants[ours][1] / best[ours]
    result = {
        "numel": n,
        "threads": torch.get_num_threads(),
        "isa": native.isa(),
        "crosstrain_ms": round(best[ours] * 1e3, 2),
        "torch_fused_ms": round(best["torch AdamW fused + casts"] * 1e3, 2),
        "torch_foreach_ms": round(best["torch AdamW foreach + casts"] * 1e3, 2),
        "speedup_vs_torch_fused": round(best["torch AdamW fused + casts"] / best[ours], 3),
        "speedup_vs_torch_foreach": round(best["torch AdamW foreach + casts"] / best[ours], 3),
        "speedup_vs_torch_fused_median": round(med["torch AdamW fused + casts"] / med[ours], 3),
        "effective_bandwidth_gbs": round(eff / 1e9, 2),
        "memcpy_bandwidth_gbs": round(copy_bw / 1e9, 2),
        "bandwidth_fraction": round(eff / copy_bw, 3),
        "inplace_stream_gbs": round(stream_bw / 1e9, 2),
        "bandwidth_fraction_vs_inplace_stream": round(eff / stream_bw, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
