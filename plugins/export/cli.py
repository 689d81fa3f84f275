"""``crosstrain export`` and ``crosstrain generate``."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from crosstrain.plugins.export.errors import ExportError


def default_out(source: Path, fmt: str) -> Path:
    if fmt == "hf":  # a folder
        return source / "export" / "hf" if source.is_dir() else source.with_name(f"{source.stem}-hf")
    ext = ".onnx" if fmt == "onnx" else ".safetensors"
    if source.is_dir():
        return source / "export" / f"model{ext}"
    return source.with_suffix(ext) if source.suffix != ext else source.with_name(source.stem + ".export" + ext)


def run_export(args: argparse.Namespace) -> int:
    from crosstrain.plugins.export.loading import load_model, save_safetensors

    for flag, value in (("--tolerance", args.tolerance), ("--int8-tolerance", args.int8_tolerance)):
        if not value >= 0:
            raise ExportError(f"{flag} must be >= 0 (a max abs logit error), got {value}")
    from crosstrain.plugins.vision.load import run_recipe

    if run_recipe(args.source) is not None:  # a classify or detect run: plugins/vision/export.py
        from crosstrain.plugins.vision.export import run_image_export

        return run_image_export(args, args.source, Path(args.out) if args.out else None)
    if getattr(args, "quantize", None) is not None or getattr(args, "ptq", None) is not None:
        from crosstrain.plugins.compress.qat.cli import run_quantized_export

        return run_quantized_export(args, Path(args.out) if args.out else None)
    source = Path(args.source)
    out = Path(args.out) if args.out else default_out(source, args.format)
    if args.format == "safetensors" and out.suffix != ".safetensors":
        raise ExportError(f"--out {out} must end in .safetensors for --format safetensors")
    if args.format == "onnx" and out.suffix != ".onnx":
        raise ExportError(f"--out {out} must end in .onnx for --format onnx")
    if args.format == "hf":
        from crosstrain.plugins.export.hf_export import export_hf

        report = export_hf(source, out, max_shard_size=args.max_shard_size, dtype=args.dtype, best=args.best)
        print(json.dumps({"format": "hf", **report}) if args.json else
              f"wrote {out} ({report['model_type']}, {report['shards']} weight file(s), "
              f"{report['total_bytes'] / 1e6:.1f} MB {args.dtype}, tokenizer: {report['tokenizer']})")
        return 0
    loaded = load_model(source, best=args.best)
    from crosstrain.plugins.export.hf_generic import refuse_native_only

    refuse_native_only(loaded, args.format)
    result: dict[str, Any] = {"source": loaded.source, "format": args.format,
                              "params": loaded.model.num_params(), "config": loaded.config.to_dict()}
    if args.format == "safetensors":
        result["path"] = str(save_safetensors(loaded, out))
        lines = [f"wrote {out}"]
    else:
        from crosstrain.plugins.export.onnx_export import export_onnx

        report = export_onnx(loaded, out, tolerance=args.tolerance, int8=args.int8,
                             int8_tolerance=args.int8_tolerance, opset=args.opset)
        result.update(report.to_dict())
        lines = report.lines()
    if args.json:
        print(json.dumps(result))
    else:
        for line in lines:
            print(line)
    return 0


def _prompt_ids(args: argparse.Namespace, tokenizer: dict[str, Any]) -> list[int]:
    from crosstrain.plugins.export.generate import encode

    if args.prompt_ids is not None:
        try:
            return [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError as exc:
            raise ExportError(f"--prompt-ids must be integers separated by commas, got {args.prompt_ids!r}") from exc
    return encode(tokenizer, args.prompt if args.prompt is not None else "")


def build_engine(model: str, engine: str, threads: int | None, workdir: str, best: bool = False) -> Any:
    """An engine for ``model``: an exported .onnx file, or anything :func:`load_model` reads (exported on the fly;
    ``best``: a run's best checkpoint)."""
    from crosstrain.plugins.export.generate import OrtEngine, TorchEngine
    from crosstrain.plugins.export.runtime import is_onnx

    if is_onnx(model):
        if best:
            raise ExportError(f"{model} is an ONNX file, and --best picks among a run's checkpoints; pass the run dir")
        if engine == "torch":
            raise ExportError(f"{model} is an ONNX file; --engine torch needs a run dir, checkpoint or .safetensors")
        if not Path(model).is_file():
            raise ExportError(f"{model} does not exist; export one with `crosstrain export ... --format onnx`")
        return OrtEngine(model, threads)
    from crosstrain.plugins.export.loading import load_model

    loaded = load_model(model, best=best)
    if engine == "torch":
        return TorchEngine(loaded.model, loaded.tokenizer, loaded.config)
    from crosstrain.plugins.export.hf_generic import refuse_native_only

    refuse_native_only(loaded, "onnx (--engine onnxruntime)")
    from crosstrain.plugins.export.onnx_export import export_onnx

    report = export_onnx(loaded, Path(workdir) / "model.onnx")
    print(f"exported to a temporary ONNX model; parity fp32: {report.parity.describe()}", file=sys.stderr)
    return OrtEngine(report.path, threads)


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from crosstrain.plugins.export.generate import Sampling, decode, generate

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)  # validated before any loading
    if args.threads is not None and args.threads < 1:
        raise ExportError(f"--threads must be >= 1, got {args.threads}")
    if args.max_new_tokens < 0:
        raise ExportError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.threads:
        torch.set_num_threads(args.threads)
    engine_name = args.engine or ("onnxruntime" if str(args.model).endswith(".onnx") else "torch")
    with tempfile.TemporaryDirectory(prefix="crosstrain-generate-") as workdir:
        engine = build_engine(args.model, engine_name, args.threads, workdir, args.best)
        prompt = _prompt_ids(args, engine.tokenizer)
        t0 = time.perf_counter()
        new = generate(engine, prompt, args.max_new_tokens, sampling, eos_id=engine.tokenizer.get("eos_id"))[0]
        seconds = time.perf_counter() - t0
    text = decode(engine.tokenizer, new)
    if args.json:
        print(json.dumps({"engine": engine_name, "backend": engine.placement.backend,
                          "device": str(engine.placement.device), "prompt_ids": prompt, "new_ids": new, "text": text,
                          "seconds": seconds, "tokens_per_s": len(new) / seconds if seconds > 0 else None}))
    else:
        print(decode(engine.tokenizer, prompt) + text)
        rate = len(new) / max(seconds, 1e-9)
        print(f"[{engine_name} on {engine.placement.device}] {len(new)} tokens in {seconds:.3f}s ({rate:.1f} tokens/s)",
              file=sys.stderr)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    from crosstrain.plugins.export.defaults import DEFAULT_INT8_TOLERANCE, DEFAULT_TOLERANCE

    p = sub.add_parser("export", help="export a trained model to ONNX (with KV cache) or safetensors",
                       description="Export a run dir (newest checkpoint), a checkpoint folder (sharded ones are "
                                   "consolidated) or a .safetensors file. ONNX exports are checked against PyTorch.")
    p.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT")
    p.add_argument("--best", action="store_true", help="the run's checkpoint with the best eval loss (keep_best)")
    p.add_argument("--format", choices=("onnx", "safetensors", "hf"), default="onnx",
                   help="hf: a Hugging Face model folder (config.json, safetensors shards, tokenizer)")
    p.add_argument("--out", default=None, help="output file (default: <run dir>/export/model.<format>)")
    p.add_argument("--int8", action="store_true", help="also write <out>.int8.onnx (int8: dynamic for a GPT, "
                   "static for an image classifier; gated)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="max abs logit error (fp32)")
    p.add_argument("--int8-tolerance", type=float, default=DEFAULT_INT8_TOLERANCE,
                   help="max abs logit error accepted for the int8 model")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    p.add_argument("--max-shard-size", default="5GB", help="hf: largest weight file before sharding (e.g. 2GB)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="hf: dtype of the written weights")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    from crosstrain.plugins.compress.qat.cli import add_arguments as add_quant_arguments

    add_quant_arguments(p)
    p.set_defaults(func=run_export)

    g = sub.add_parser("generate", help="generate text from an exported or trained model (KV cache)")
    g.add_argument("model", metavar="MODEL",
                   help="a .onnx file, a run dir, a checkpoint, a .safetensors file or a Hugging Face model folder")
    g.add_argument("--best", action="store_true", help="the run's checkpoint with the best eval loss (keep_best)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (the model's tokenizer: bytes, or its tokenizer.json)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma separated")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--engine", choices=("onnxruntime", "torch"), default=None,
                   help="default: onnxruntime for .onnx files, torch otherwise")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--threads", type=int, default=None, help="CPU threads for the engine")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=run_generate)
