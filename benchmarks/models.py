"""Native vs generic (issue 29): the same Llama-shaped model trained by crosstrain's own GPT and by transformers'
``LlamaForCausalLM`` on the generic path (``model.source = "transformers"`` builds the preset's shape as a Llama
config.json), under the same loop, layout (1 process), threads, batch, sequence length and optimizer.

Throughput: both paths alternate in this process (one untimed warm-up run each, then ABBA order, ``--rounds``
times, :func:`_timing.alternate`); each run's first ``--warmup`` step intervals are dropped and tokens/s is
batch x seq / the median step time, read on ``--clock``: by default this process's CPU time (``--threads 1``
on the CPU: the work of the step, unaffected by other jobs on a shared machine), or ``wall``.
``parallel.compile`` is the same for both (``--compile``, default false: the models compared, not the compiler's
choice). Peak memory is measured apart, each path in a fresh process (this
script with ``--memory PATH``): on an accelerator the allocator's peak, on the CPU the growth of the peak resident
set over the training run (transformers imported in both, before the measurement starts).

    python benchmarks/models.py [--preset small] [--rounds 3] [--quick]

The bound (issue 40): after each timed run, one more run of the same path under a dispatch mode that reads the same
clock around every GEMM and fused-attention call (:data:`IRREDUCIBLE`, forward and backward) gives the seconds per
step no change to the model's code can remove (median over the rounds); ``speedup_bound`` is the generic step time
over the native path's irreducible seconds: the ``native_vs_transformers`` the native path would reach with every
other op (norms, rotary, activations, residual adds, copies, the optimizer step, Python) free. ``of_bound`` =
``native_vs_transformers / speedup_bound`` is the share of the native step spent in those ops (target >= 0.9);
``speedup_bound_gemm_only`` counts the GEMMs alone.

Last line: JSON with ``native_vs_transformers`` (native tokens/s / generic tokens/s; target >= 1.3), ``speedup_bound``,
``of_bound``, ``step_s``/``irreducible_s``/``gemm_s`` per path, ``step_ms_by_op`` (where each path's step goes:
GEMMs, attention, each other aten op or native CPU kernel (``ext:...``) above 0.5% of the step, the rest of them,
and ``timed ops``, their sum; ``step_s`` minus it is Python, autograd and dispatch; timed in the bound's runs), and
``memory_ratio`` (native peak / generic peak; target <= 1.0) and ``window_mem_ratio`` (peak memory of crosstrain's
windowed attention / dense boolean-mask SDPA at T = 4096 with a 512 window, forward + backward, measured by
benchmarks/attention_masks.py's ``layout``; target <= 0.25), with per-path detail.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
from _timing import alternate, step_clock  # noqa: E402
from attention_masks import layout as attention_layout  # noqa: E402

# This folder's kernels.py would shadow the `kernels` package transformers imports when it is installed
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

PATHS = ("native", "transformers")


def _sets(path: str, args: argparse.Namespace, out: str) -> list[str]:
    return ["backend=auto", f"model.preset={args.preset}", "model.vocab_size=256", f"model.source={path}",
            f"train.steps={args.steps}", f"train.batch_size={args.batch}", f"train.seq_len={args.seq}",
            f"train.threads={args.threads}", f"parallel.compile={args.compile}", "logging.progress=none",
            "eval.every=0",
            "checkpoint.every=0", "schedule.warmup_steps=0", f"train.output_dir={out}"]


def train(path: str, args: argparse.Namespace) -> tuple[list[float], dict[str, Any]]:
    """One run on ``path``: its step intervals and summary."""
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    clock_fn = time.process_time if args.clock == "cpu" else time.perf_counter
    with tempfile.TemporaryDirectory(prefix=f"bench-models-{path}-") as out, step_clock(clock_fn) as clock:
        summary = Trainer(load_config(None, _sets(path, args, out)), run_dir=out).fit()
    return clock.intervals, summary


#: the ops no change to the model's code can make cheaper: its GEMMs and the fused attention kernel (two GEMMs
#: and their softmax), forward and backward, the same calls in both paths
IRREDUCIBLE = ("mm", "addmm", "addmm_", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention",
               "_scaled_dot_product_cudnn_attention_backward")
GEMMS = IRREDUCIBLE[:5]


class _TimedExtension:
    """A compiled extension module whose every function adds its seconds on ``clock`` to ``spent["ext:<name>"]``
    (the native kernels are called through ``data_ptr()`` addresses, so no dispatch mode sees them)."""

    def __init__(self, module: Any, clock: Any, spent: dict[str, float]) -> None:
        self._module, self._clock, self._spent = module, clock, spent

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._module, name)
        if not callable(fn):
            return fn

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = self._clock()
            try:
                return fn(*a, **kw)
            finally:
                key = f"ext:{name}"
                self._spent[key] = self._spent.get(key, 0.0) + self._clock() - t0

        return timed


def irreducible(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per step (median over the steps after ``--warmup``) that one run on ``path`` spends in the
    :data:`IRREDUCIBLE` ops, and in its GEMMs alone, read on ``--clock`` around each such op by a dispatch mode
    (every aten call, forward and backward, passes through it; the mode's own overhead falls outside the ops).
    ``ops``: the mean seconds per step (same steps) of every aten op and every call into the CPU backend's native
    extensions (``ext:<function>``), where the rest of the step goes."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    clock_fn = time.process_time if args.clock == "cpu" else time.perf_counter
    spent = {"irreducible": 0.0, "gemm": 0.0}
    ops: dict[str, float] = {}
    sync = torch.accelerator.synchronize if args.clock == "wall" and torch.accelerator.is_available() else None

    class Timer(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, a: tuple = (), kw: dict | None = None) -> Any:
            name = func.overloadpacket.__name__
            if sync is not None:
                sync()
            t0 = clock_fn()
            out = func(*a, **(kw or {}))
            if sync is not None:
                sync()
            dt = clock_fn() - t0
            ops[name] = ops.get(name, 0.0) + dt
            if name in IRREDUCIBLE:
                spent["irreducible"] += dt
            if name in GEMMS:
                spent["gemm"] += dt
            return out

    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    extensions = _native_extensions()
    try:
        for holder, attr in extensions:
            setattr(holder, attr, _TimedExtension(getattr(holder, attr), clock_fn, ops))
        with tempfile.TemporaryDirectory(prefix=f"bench-models-{path}-") as out, \
                step_clock(lambda: spent["irreducible"]) as both, step_clock(lambda: spent["gemm"]) as gemm, \
                step_clock(lambda: dict(ops)) as snapshots, Timer():
            Trainer(load_config(None, _sets(path, args, out)), run_dir=out).fit()
    finally:
        for holder, attr in extensions:
            setattr(holder, attr, getattr(holder, attr)._module)
    first, last = snapshots.readings[args.warmup], snapshots.readings[-1]
    steps = len(snapshots.readings) - 1 - args.warmup
    return {"irreducible": statistics.median(both.intervals[args.warmup:]),
            "gemm": statistics.median(gemm.intervals[args.warmup:]),
            "ops": {k: (v - first.get(k, 0.0)) / steps for k, v in last.items()}}


def _native_extensions() -> list[tuple[Any, str]]:
    """(module, attribute) of each loaded native CPU extension (optimizer steps, model ops), to time its calls."""
    try:
        from crosstrain.backends.cpu import native
        from crosstrain.backends.cpu.native import kernels
    except ImportError:
        return []
    return [(m, a) for m, a in ((native, "_native"), (kernels, "_ext")) if getattr(m, a, None) is not None]


def breakdown(step: float, floors: list[dict[str, Any]], share: float = 0.005) -> dict[str, float]:
    """Milliseconds per step by op (median over the rounds): GEMMs, the fused attention, each other op or native
    kernel above ``share`` of ``step``, the rest of them together (``other ops``) and ``timed ops``, the sum of
    them all: ``step`` minus it is Python, autograd and dispatch, read across runs (the bound's runs are not the
    timed ones, so under load the difference carries their noise, and each op's two clock readings add ~1 us)."""
    names = {k for f in floors for k in f["ops"]}
    per = {k: statistics.median([f["ops"].get(k, 0.0) for f in floors]) for k in names}
    out = {"gemm": sum(v for k, v in per.items() if k in GEMMS),
           "attention": sum(v for k, v in per.items() if k in IRREDUCIBLE and k not in GEMMS)}
    rest = {k: v for k, v in per.items() if k not in IRREDUCIBLE}
    out.update({k: v for k, v in sorted(rest.items(), key=lambda kv: -kv[1]) if v >= share * step})
    out["other ops"] = sum(v for k, v in rest.items() if v < share * step)
    out["timed ops"] = sum(per.values())
    return {k: round(v * 1000, 2) for k, v in out.items()}


def memory(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Peak memory of one short run on ``path`` in this (fresh) process."""
    import torch
    import transformers  # noqa: F401  (imported before the baseline, for both paths alike)

    from crosstrain.hostmem import current_rss, peak_rss, reset_peak_rss

    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accel is not None:
        torch.accelerator.reset_peak_memory_stats()
    reset_peak_rss()
    base = current_rss()
    _, summary = train(path, args)
    if accel is not None:
        return {"peak_bytes": int(torch.accelerator.max_memory_allocated()), "measure": f"{accel.type} allocator",
                "loss": summary["losses"][-1]}
    return {"peak_bytes": peak_rss() - base, "measure": "cpu peak RSS growth", "loss": summary["losses"][-1]}


def _memory_in_fresh_process(path: str, argv: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--memory", path], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", default="false",
                        help="parallel.compile for both paths (auto: crosstrain's choice)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: this process's CPU seconds per step (robust to other jobs on a shared machine, "
                             "exact for one thread on the CPU); wall: wall seconds (use on an accelerator)")
    parser.add_argument("--quick", action="store_true", help="shorter runs: 8 steps, 2 rounds, seq 128")
    parser.add_argument("--memory", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.seq = 8, 2, 128
    if args.memory:
        print(json.dumps(memory(args.memory, args)))
        return
    import torch

    torch.set_num_threads(args.threads)
    for path in PATHS:  # untimed warm-up of each path (imports, allocator)
        train(path, args)
    compiled: dict[str, Any] = {}
    floors: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}

    def timed(path: str, r: int) -> list[float]:
        intervals, summary = train(path, args)
        compiled[path] = summary["defaults"]["compile"]["enabled"]
        floors[path].append(irreducible(path, args))  # next to its timed run, so a drift of the machine hits both
        return intervals[args.warmup:]

    runs = alternate(PATHS, args.rounds, timed)
    tokens = args.batch * args.seq
    step_s = {path: statistics.median([s for run in runs[path] for s in run]) for path in PATHS}
    tps = {path: tokens / step_s[path] for path in PATHS}
    floor = {path: {k: statistics.median([f[k] for f in floors[path]]) for k in ("irreducible", "gemm")}
             for path in PATHS}
    where = {path: breakdown(step_s[path], floors[path]) for path in PATHS}
    passthrough = [f"--preset={args.preset}", f"--batch={args.batch}", f"--seq={args.seq}", f"--steps={args.steps}",
                   f"--threads={args.threads}", f"--compile={args.compile}"]
    mem = {path: _memory_in_fresh_process(path, passthrough) for path in PATHS}
    window = attention_layout(4096, 512, None, 1)
    ratio = tps["native"] / tps["transformers"]
    # the native path with every op but its GEMMs and attention kernel free, against the measured generic step
    bound = step_s["transformers"] / floor["native"]["irreducible"]
    result = {
        "native_vs_transformers": round(ratio, 3),
        "speedup_bound": round(bound, 3),
        "of_bound": round(ratio / bound, 3),
        "speedup_bound_gemm_only": round(step_s["transformers"] / floor["native"]["gemm"], 3),
        "step_s": {p: round(v, 4) for p, v in step_s.items()},
        "irreducible_s": {p: round(v["irreducible"], 4) for p, v in floor.items()},
        "gemm_s": {p: round(v["gemm"], 4) for p, v in floor.items()},
        "step_ms_by_op": where,
        "memory_ratio": round(mem["native"]["peak_bytes"] / max(mem["transformers"]["peak_bytes"], 1), 3),
        "window_mem_ratio": round(window["mem_ratio"], 3),
        "tokens_per_s": {p: round(v, 1) for p, v in tps.items()},
        "peak_bytes": {p: m["peak_bytes"] for p, m in mem.items()}, "memory_measure": mem["native"]["measure"],
        "preset": args.preset, "batch": args.batch, "seq_len": args.seq, "threads": args.threads,
        "steps": args.steps, "rounds": args.rounds, "compile": args.compile, "clock": args.clock,
        "compiled": {p: s for p, s in compiled.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
