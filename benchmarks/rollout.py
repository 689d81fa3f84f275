"""Rollout throughput: the static-KV-cache engine vs recomputing the whole prefix vs the concatenating cache.

Greedy decoding of ``--new-tokens`` tokens after a batch of ``--batch`` random ``--prompt-len``-token prompts on a
random GPT ``--preset``, three ways, side by side: repetitions interleave the methods (rotating their order), and
each figure is the median tokens/s over the repetitions.

- ``engine``: :func:`crosstrain.generation.generate` (preallocated cache written in place, one forward per token);
- ``engine_compiled``: the same with ``GenerationConfig(compile=True)`` (each decode step one ``torch.compile``-d
  static-shape forward over the whole cache); its first call, which compiles, is timed apart as ``compile_s``
  (``--no-compile`` leaves it out);
- ``recompute``: ``GPT.forward`` over the whole sequence for every new token (no cache);
- ``concat``: ``GPT.forward_with_cache``, whose per-layer cache is ``torch.cat``-extended every token.

All must emit the same tokens (checked). Prints a table, then ONE JSON line with ``kv_cache_speedup``
(engine / recompute, goal >= 5) and ``static_over_concat`` (engine / concat, goal >= 1.3) from the medians,
``compiled_over_concat`` and ``compiled_over_engine`` likewise, the same ratios from each method's fastest
repetition (``*_best``), the tokens/s of each, ``compile_s``, and the machine's load average (the figures are
only comparable on a quiet machine).

    python benchmarks/rollout.py [--preset small] [--batch 16] [--new-tokens 128] [--prompt-len 32] [--reps 3]
                                 [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from crosstrain.generation import GenerationConfig, generate
from crosstrain.models.gpt import GPT, build_gpt


def run_engine(model: GPT, prompts: torch.Tensor, steps: int) -> torch.Tensor:
    return generate(model, prompts.tolist(), GenerationConfig(max_new_tokens=steps, greedy=True)).tokens


def run_engine_compiled(model: GPT, prompts: torch.Tensor, steps: int) -> torch.Tensor:
    return generate(model, prompts.tolist(), GenerationConfig(max_new_tokens=steps, greedy=True, compile=True)).tokens


@torch.no_grad()
def run_recompute(model: GPT, prompts: torch.Tensor, steps: int) -> torch.Tensor:
    ids = prompts
    for _ in range(steps):
        ids = torch.cat((ids, model(ids)[:, -1].argmax(-1, keepdim=True)), dim=1)
    return ids[:, prompts.shape[1]:]


@torch.no_grad()
def run_concat(model: GPT, prompts: torch.Tensor, steps: int) -> torch.Tensor:
    out = []
    logits, past = model.forward_with_cache(prompts, None)
    for t in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        if t + 1 < steps:
            logits, past = model.forward_with_cache(nxt, past)
    return torch.cat(out, dim=1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--device", default="cpu", help="e.g. cpu, cuda")
    ap.add_argument("--no-compile", action="store_true", help="leave out engine_compiled (compiling takes a while)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_gpt(args.preset).to(device).eval()
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len), device=device)
    methods: dict[str, Callable[[GPT, torch.Tensor, int], torch.Tensor]] = {
        "engine": run_engine, "recompute": run_recompute, "concat": run_concat}
    tokens = {name: fn(model, prompts, 4) for name, fn in methods.items()}  # warm-up
    compile_s = None
    if not args.no_compile:  # compiles for the timed shapes (dynamic=False: one graph per cache length)
        _sync(device)
        t0 = time.perf_counter()
        tokens["engine_compiled"] = run_engine_compiled(model, prompts, args.new_tokens)
        _sync(device)
        compile_s = time.perf_counter() - t0
        methods["engine_compiled"] = run_engine_compiled
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            _sync(device)
            t0 = time.perf_counter()
            tokens[name] = methods[name](model, prompts, args.new_tokens)
            _sync(device)
            seconds[name].append(time.perf_counter() - t0)
    new = args.batch * args.new_tokens
    tps = {name: new / statistics.median(s) for name, s in seconds.items()}
    best = {name: new / min(s) for name, s in seconds.items()}  # less sensitive to other processes' bursts
    match = all(torch.equal(tokens["engine"], tokens[n]) for n in methods)
    result = {
        "preset": args.preset, "batch": args.batch, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
        "reps": args.reps, "device": str(device), "threads": torch.get_num_threads(),
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()}, "tokens_match": match,
        "kv_cache_speedup": round(tps["engine"] / tps["recompute"], 3),
        "static_over_concat": round(tps["engine"] / tps["concat"], 3),
        "kv_cache_speedup_best": round(best["engine"] / best["recompute"], 3),
        "static_over_concat_best": round(best["engine"] / best["concat"], 3),
        "compile_s": None if compile_s is None else round(compile_s, 1),
        **({} if compile_s is None else {
            "compiled_over_concat": round(tps["engine_compiled"] / tps["concat"], 3),
            "compiled_over_engine": round(tps["engine_compiled"] / tps["engine"], 3),
            "compiled_over_concat_best": round(best["engine_compiled"] / best["concat"], 3)}),
        "loadavg": list(os.getloadavg()),
    }
    for name in names:
        print(f"{name:>10}: {tps[name]:9.1f} tokens/s  (runs: {', '.join(f'{s:.2f}s' for s in seconds[name])})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
