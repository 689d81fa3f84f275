"""``crosstrain distill cache TEACHER [--data PATH] [--config FILE] [--set K=V] [--top-k K] --out FILE``: the
teacher's top-k log-probs over the run's train and held-out data, written once (:mod:`.cache`); ``crosstrain
distill demo``: a teacher trained and distilled on the embedded corpus in one command (:mod:`.demo`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("distill", help="knowledge distillation tools (docs/compress.md)")
    sub = p.add_subparsers(dest="distill_command", required=True, metavar="COMMAND")
    c = sub.add_parser("cache", help="write a teacher's top-k log-probs for --recipe distill (distill.cache=FILE)",
                       description="Runs TEACHER once over the data a distill run with the same --config/--set "
                                   "trains and evaluates on, and writes its top-k log-probs (safetensors, "
                                   "checksummed).")
    c.add_argument("teacher", metavar="TEACHER", help="a run dir, checkpoint, .safetensors file or HF folder")
    c.add_argument("--out", required=True, help="the cache file to write (.safetensors)")
    c.add_argument("--data", default=None, help="data.path (default: the config's, else the embedded data)")
    c.add_argument("--config", default=None, help="the distill run's config file")
    c.add_argument("--set", action="append", default=[], metavar="K=V", help="config override (repeatable)")
    c.add_argument("--top-k", type=int, default=16, help="tokens kept per position (default 16)")
    c.set_defaults(func=run_cache)
    d = sub.add_parser("demo", help="train a small teacher on the embedded corpus and distill a tiny student from it",
                       description="The one-command demo (about a minute of CPU time): RUN_DIR/teacher (--recipe lm, "
                                   "preset small), RUN_DIR/baseline (preset tiny on the labels alone) and "
                                   "RUN_DIR/student (the same tiny student, --recipe distill); prints progress and the "
                                   "three held-out NLLs. SIGTERM/SIGINT stops it after the running step "
                                   "(exit 143/130); the same command continues.")
    d.add_argument("--run-dir", default="runs/distill-demo", help="where the runs go (default runs/distill-demo)")
    d.add_argument("--teacher-steps", type=int, default=200)
    d.add_argument("--steps", type=int, default=150, help="student steps (both students)")
    d.add_argument("--set", action="append", default=[], metavar="K=V", help="config override for every run")
    d.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    import json

    from crosstrain.engine.resume_hint import resume_command
    from crosstrain.errors import ConfigError
    from crosstrain.plugins.compress.distill import demo

    if args.teacher_steps < 1 or args.steps < 1:
        raise ConfigError("--teacher-steps and --steps must be >= 1")
    run_dir = Path(args.run_dir)
    argv = list(getattr(args, "cli_argv", None) or ["distill", "demo"])
    resume = resume_command(argv, run_dir)
    result = demo.run_demo(run_dir, args.teacher_steps, args.steps, list(args.set), resume)
    if isinstance(result, int):
        return result
    if result.get("kd_vs_ce") is not None:
        print(f"crosstrain: distill demo: held-out NLL teacher {result['eval_nll_teacher']:.4f}, student on labels "
              f"alone {result['eval_nll_baseline']:.4f}, distilled {result['eval_nll_student']:.4f} (kd_vs_ce "
              f"{result['kd_vs_ce']:.3f}; < 1: distillation helped)", flush=True)
    print(json.dumps(result))
    return 0


def run_cache(args: argparse.Namespace) -> int:
    import json

    import torch

    from crosstrain.config import gpt_config, load_config
    from crosstrain.errors import ConfigError
    from crosstrain.plugins.compress.distill import cache, data
    from crosstrain.plugins.compress.distill.progress import ProgressLine
    from crosstrain.plugins.compress.distill.teacher import check_source, load_teacher

    out = Path(args.out)
    if out.suffix != ".safetensors":
        raise ConfigError(f"--out {out} must end in .safetensors")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: folder {out.parent} does not exist; create it first")
    overrides = [*args.set, *([f"data.path={args.data}"] if args.data else []), "train.recipe=distill"]
    config = load_config(args.config, overrides)
    sec = config.section("distill")
    check_source(args.teacher)
    train, held, _ = data.build(config)
    vocab = gpt_config(config).vocab_size
    if not 1 <= args.top_k <= vocab:
        raise ConfigError(f"--top-k={args.top_k} must be between 1 and the vocabulary size {vocab}")
    teacher = load_teacher(args.teacher, vocab)
    splits = {"train": train, **({"eval": held} if held is not None else {})}
    temperature = sec.loss_temperature
    say = ProgressLine()
    say(f"teacher {teacher.source} (sha256 {teacher.sha256[:12]}...), top-{args.top_k}, " +
        " + ".join(f"{len(ds)} {name}" for name, ds in splits.items()) + " samples")
    tensors: dict[str, torch.Tensor] = {}
    for name, ds in splits.items():
        ids, logps, nll = cache.compute(teacher.model, ds, args.top_k, temperature, torch.device("cpu"),
                                        on_batch=say.counter(name, len(ds)))
        tensors.update({f"{name}_ids": ids, f"{name}_logps": logps, f"{name}_nll": nll})
    say(f"writing {out}")
    meta = {"teacher_source": teacher.source, "teacher_sha256": teacher.sha256, "vocab_size": vocab,
            "top_k": args.top_k, "temperature": temperature, "data_sha256": data.fingerprint(splits),
            "samples": {k: len(v) for k, v in splits.items()}}
    checksum = cache.write(out, tensors, meta)
    print(json.dumps({"out": str(out), "payload_sha256": checksum, "bytes": out.stat().st_size, **meta}))
    return 0
