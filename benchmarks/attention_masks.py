"""Peak memory and time of sliding-window attention: crosstrain's (:mod:`crosstrain.models.attention_masks`) vs
SDPA with the dense ``[B, 1, T, T]`` boolean mask, forward and backward, side by side in one run.

Layouts (``B=1, H=8, D=64`` fp32 on CPU): a 512-token sliding window at ``T = 4096`` (the issue's figure) and, in
the full run, the same window over packed documents and ``T = 8192``. Memory is measured by torch's profiler
(``profile_memory=True``): every allocation and free of the CPU allocator is an event carrying the allocator's
running "Total Allocated"; a layout's figure is the peak of that total during one forward + backward (mask
construction included) above its value just before the first allocation, so it counts the mask, scores,
softmax, outputs, saved activations and gradients, not the inputs q/k/v. (``tracemalloc`` sees no torch memory
and RSS keeps freed pages, so neither is used.) Times: median wall seconds of the forward + backward, measured
outside the profiler, ABBA-alternated. Last line JSON: ``window_mem_ratio`` (crosstrain / dense peak at T = 4096,
window 512), ``window_workspace_ratio`` (the same above the floor every attention's backward holds: the q/k/v gradients,
``3 B H T D`` floats; what is left is the part that is ``T^2`` for the dense mask) and every layout's bytes and seconds.

    python benchmarks/attention_masks.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _timing import alternate, seconds
from torch.profiler import ProfilerActivity, profile

from crosstrain.models.attention_masks import AttentionMask, attention, attention_backend
from crosstrain.models.document_mask import segment_index

B, H, D = 1, 8, 64
Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _inputs(t: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, t, D, generator=g, requires_grad=True) for _ in range(3))


def _runners(t: int, window: int, segments: torch.Tensor | None) -> dict[str, Run]:
    def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=AttentionMask(t, window, segments).dense())

    def crosstrain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, AttentionMask(t, window, segments))

    return {"dense": dense, "crosstrain": crosstrain}


def _step(run: Run, t: int) -> None:
    q, k, v = _inputs(t)
    run(q, k, v).sum().backward()


def peak_bytes(run: Run, t: int) -> int:
    """Peak bytes the CPU allocator held during one forward + backward above its level before it (see above)."""
    q, k, v = _inputs(t)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(q, k, v).sum().backward()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0),
                 key=lambda e: e["ts"])
    if not mem:
        raise RuntimeError("the profiler recorded no memory events")
    start = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return int(max(e["args"]["Total Allocated"] for e in mem) - start)


def layout(t: int, window: int, docs: list[int] | None, rounds: int) -> dict[str, float]:
    segments = None if docs is None else segment_index(
        torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])[None])
    runners = _runners(t, window, segments)
    out: dict[str, float] = {}
    for name, run in runners.items():
        _step(run, t)  # warm-up: lazy imports and first-call allocations stay out of the figures
        out[f"{name}_peak_bytes"] = peak_bytes(run, t)
    times = alternate(list(runners), rounds, lambda name, _: seconds(lambda: _step(runners[name], t)))
    for name, values in times.items():
        out[f"{name}_s"] = statistics.median(values)
    out["mem_ratio"] = out["crosstrain_peak_bytes"] / out["dense_peak_bytes"]
    # what any attention's backward must produce: the q, k and v gradients (fp32)
    floor = 3 * B * H * t * D * 4
    out["floor_bytes"] = floor
    out["workspace_ratio"] = (out["crosstrain_peak_bytes"] - floor) / (out["dense_peak_bytes"] - floor)
    out["time_ratio"] = out["crosstrain_s"] / out["dense_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="T = 4096 with a 512 window only, one timing round")
    args = parser.parse_args()
    torch.manual_seed(0)
    rounds = 1 if args.quick else 3
    layouts = {"T4096_w512": (4096, 512, None)}
    if not args.quick:
        layouts["T4096_w512_docs"] = (4096, 512, [300, 1800, 1000, 996])
        layouts["T8192_w512"] = (8192, 512, None)
    results = {name: layout(t, w, docs, rounds) for name, (t, w, docs) in layouts.items()}
    for name, r in results.items():
        print(f"{name}: crosstrain {r['crosstrain_peak_bytes'] / 2**20:.1f} MiB vs dense "
              f"{r['dense_peak_bytes'] / 2**20:.1f} MiB (ratio {r['mem_ratio']:.3f}); "
              f"{r['crosstrain_s']:.3f} s vs {r['dense_s']:.3f} s")
    print(json.dumps({"window_mem_ratio": results["T4096_w512"]["mem_ratio"],
                      "window_workspace_ratio": results["T4096_w512"]["workspace_ratio"], "batch": B, "heads": H,
                      "head_dim": D, "backend": attention_backend(torch.device("cpu")), "layouts": results}))


if __name__ == "__main__":
    main()
