"""``crosstrain export SOURCE --format hf --out DIR``: a Hugging Face model folder that transformers loads.

Writes ``config.json`` (``LlamaForCausalLM``, the family that computes the model's options, or the model_type of
the folder it was imported from: ``hf_config_from_gpt``), the weights as safetensors (``model.safetensors``, or numbered
shards + ``model.safetensors.index.json`` above ``--max-shard-size``), the tokenizer files (the run's
``data.tokenizer`` folder with its chat template, or a generated ``tokenizer.json`` for the byte tokenizer) and
``generation_config.json`` with the run's stop tokens (:mod:`.hf_generation`). From a checkpoint of any
layout (FSDP/TP/PP shards) tensors are read one output shard at a time (:mod:`.stream`), so the model is never
materialised twice. Everything is written into a temporary folder renamed into place at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from crosstrain.checkpoint.atomic import atomic_write
from crosstrain.models.gpt import GPT, GPTConfig
from crosstrain.plugins.export.errors import ExportError

if TYPE_CHECKING:
    from crosstrain.checkpoint.resolve import Resolved

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WeightSource:
    """A model to export: its config, tokenizer metadata, and its tensors by GPT name, loadable in groups."""

    config: GPTConfig
    tokenizer: dict[str, Any]
    source: str
    shapes: dict[str, tuple[int, ...]]
    load: Callable[[list[str]], dict[str, torch.Tensor]]
    base_config: dict[str, Any] | None = None
    origin: Path | None = None  # the Hugging Face folder the model came from (its generation_config.json)
    extra: dict[str, Any] = field(default_factory=dict)


def _expected(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in GPT(cfg).state_dict().items()}


def _checked(cfg: GPTConfig, shapes: dict[str, tuple[int, ...]], source: str,
             model: torch.nn.Module | None = None) -> GPTConfig:
    """``cfg`` (vocabulary from the embedding) once ``shapes`` are those of the GPT it builds, or of ``model`` (the
    GPT with what plugins' transforms added, e.g. MoE experts)."""
    emb = shapes.get("tok_embeddings.weight")
    if emb is not None and emb[0] != cfg.vocab_size and emb[1] == cfg.dim:
        cfg = dataclasses.replace(cfg, vocab_size=emb[0])  # vocabulary set by the data pipeline
    expected = _expected(cfg) if model is None else {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(shapes) - ({"output.weight"} if cfg.tie_embeddings else set()))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        detail = f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
        raise ExportError(f"{source} is not a crosstrain GPT checkpoint ({detail}); only the built-in GPT exports")
    for name, shape in shapes.items():
        if shape != expected[name]:
            raise ExportError(f"{source}: {name} has shape {shape} but the model config expects {expected[name]}")
    return cfg


def origin_folder(run_config: Path | None) -> Path | None:
    """The Hugging Face folder a run was initialised from (``model.init_from``, directly or through other runs:
    :func:`~crosstrain.models.init_chain.init_origin`), when it still exists."""
    if run_config is None or not run_config.is_file():
        return None
    init_from = (json.loads(run_config.read_text()).get("model") or {}).get("init_from")
    if not init_from or not Path(init_from).exists():
        return None
    from crosstrain.models.init_chain import init_origin

    origin = init_origin(init_from)
    return origin.hf_folder if origin is not None else None


def _base_config(origin: Path | None) -> dict[str, Any] | None:
    from crosstrain.models.hf import read_hf_config

    return read_hf_config(origin) if origin is not None else None


def _checkpoint_source(source: Resolved) -> WeightSource:
    from crosstrain.plugins.export.loading import _config_near, run_tokenizer
    from crosstrain.plugins.export.stream import CheckpointTensors

    ckpt, run_dir = source.path, source.run_dir
    tensors = CheckpointTensors(source)
    candidates = [ckpt / "config.json", ckpt / "model_config.json"]
    if run_dir is not None:
        candidates.append(run_dir / "config.json")
    shapes = tensors.shapes()
    cfg = _config_near(candidates, str(ckpt))
    origin = origin_folder(run_dir / "config.json" if run_dir else None)
    base = _base_config(origin)
    if set(shapes) - set(_expected(cfg)):  # e.g. LoRA adapters: the plugins' export hook needs the whole state
        from crosstrain.plugins.export.loading import load_checkpoint_dir

        loaded = load_checkpoint_dir(source)
        state = loaded.model.state_dict()
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        return WeightSource(_checked(loaded.config, shapes, str(ckpt), loaded.model), loaded.tokenizer,
                            loaded.source, shapes, lambda names: {n: state[n] for n in names}, base, origin)
    cfg = _checked(cfg, shapes, str(ckpt))
    return WeightSource(cfg, run_tokenizer(candidates, cfg), str(ckpt), shapes, tensors.load, base, origin)


def open_source(path: str | os.PathLike[str], *, best: bool = False) -> WeightSource:
    """What ``path`` points to (:func:`~crosstrain.checkpoint.resolve.resolve_path`): checkpoints stream; files
    and HF folders are loaded once."""
    from crosstrain.checkpoint.resolve import resolve_path
    from crosstrain.plugins.export.loading import load_model

    source = resolve_path(path, best=best)
    if source.kind == "checkpoint":
        return _checkpoint_source(source)
    loaded = load_model(source)
    state = loaded.model.state_dict()
    return WeightSource(loaded.config, loaded.tokenizer, loaded.source, {k: tuple(v.shape) for k, v in state.items()},
                        lambda names: {n: state[n] for n in names}, loaded.extra.get("hf_config"),
                        source.path if source.kind == "hf" else None)


def _replace_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        from crosstrain.models.hf import is_hf_folder

        if out.is_file() or (any(out.iterdir()) and not is_hf_folder(out)):
            raise ExportError(f"--out {out} exists and is not a Hugging Face model folder; pass a new or empty folder")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def export_hf(source: str | os.PathLike[str], out: str | os.PathLike[str], *, max_shard_size: str | int = "5GB",
              dtype: str = "float32", best: bool = False,
              weights: Callable[[WeightSource], WeightSource] | None = None) -> dict[str, Any]:
    """Export ``source`` (with ``best``: a run's best checkpoint) as a Hugging Face folder ``out``; returns a
    report (files, shards, bytes, model_type). ``weights`` changes the tensors read (e.g. dequantised QAT weights)."""
    from crosstrain.models.hf import adapter_for, parse_size, plan_shards, write_weights
    from crosstrain.models.hf.adapter import find_adapter
    from crosstrain.plugins.export.hf_generation import write_generation_files

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    out_path = Path(out).resolve()
    if out_path == Path(source).resolve():
        raise ExportError(f"--out {out_path} is the source folder; export into another folder")
    from crosstrain.plugins.export.hf_generic import export_generic

    generic = export_generic(source, out_path, max_shard_size=max_shard_size, dtype=dtype, best=best)
    if generic is not None:  # a run on the generic (transformers) path: save_pretrained
        return generic
    src = open_source(source, best=best)
    if weights is not None:
        src = weights(src)
    cfg, torch_dtype = src.config, DTYPES[dtype]
    # the config of the model_type it was imported from (a plugin's, e.g. Mixtral, writes its own), else Llama's
    origin = find_adapter((src.base_config or {}).get("model_type")) or adapter_for("llama")
    try:
        hf_config = origin.hf_config(cfg, base=src.base_config, dtype=dtype, eos_id=src.tokenizer.get("eos_id"),
                                     shapes=src.shapes)
    except ValueError as exc:  # an option no Hugging Face family computes (Gemma 3 attention soft-capping, ...)
        raise ExportError(f"{src.source}: {exc}; export it with --format safetensors or onnx") from None
    adapter = adapter_for(hf_config["model_type"])
    expected = _expected(cfg)  # then what plugins' modules added (MoE experts), in the source's order
    order = [n for n in [*expected, *(n for n in src.shapes if n not in expected)]
             if n in src.shapes and not (cfg.tie_embeddings and n == "output.weight")]
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    # one unit per HF tensor (a fused one, e.g. Phi-3's qkv_proj, gathers its crosstrain members)
    try:
        groups = {adapter.to_hf(g[0]): g for g in adapter.export_groups(order)}
    except KeyError as exc:  # e.g. MoE experts trained from scratch: only an imported Mixtral keeps its format
        raise ExportError(f"{src.source}: {exc.args[0]}, so the model has modules the {hf_config['model_type']} "
                          "format lacks; export it with --format safetensors or onnx") from None
    sizes = [(h, itemsize * sum(int(torch.Size(src.shapes[n]).numel()) for n in g)) for h, g in groups.items()]
    shards = plan_shards(sizes, parse_size(max_shard_size))

    def load(hf_names: list[str]) -> dict[str, torch.Tensor]:
        tensors = src.load([n for h in hf_names for n in groups[h]])
        return {h: t.to(torch_dtype) for h, t in adapter.to_hf_tensors(tensors).items()}

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        files = [p.name for p in write_weights(tmp, shards, load)]
        atomic_write(tmp / "config.json", json.dumps(hf_config, indent=2) + "\n")
        files += ["config.json", *write_generation_files(src.tokenizer, src.origin, cfg, tmp)]
        _replace_dir(tmp, out_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"path": str(out_path), "source": src.source, "model_type": hf_config["model_type"], "dtype": dtype,
            "shards": len(shards), "total_bytes": sum(s for _, s in sizes), "files": sorted(files),
            "tokenizer": src.tokenizer.get("type")}
