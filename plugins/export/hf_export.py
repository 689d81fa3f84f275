"""``crosstrain export SOURCE --format hf --out DIR``: a Hugging Face model folder that transformers loads.

Writes ``config.json`` (``LlamaForCausalLM``, the family that computes the model's options, or the model_type of
the folder it was imported from: ``hf_config_from_gpt``), the weights as safetensors (``model.safetensors``, or numbered
shards + ``model.safetensors.index.json`` above ``--max-shard-size``) and the tokenizer files (the run's
``data.tokenizer`` folder, or a generated ``tokenizer.json`` for the byte tokenizer). From a checkpoint of any
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
    extra: dict[str, Any] = field(default_factory=dict)


def _expected(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in GPT(cfg).state_dict().items()}


def _checked(cfg: GPTConfig, shapes: dict[str, tuple[int, ...]], source: str) -> GPTConfig:
    emb = shapes.get("tok_embeddings.weight")
    if emb is not None and emb[0] != cfg.vocab_size and emb[1] == cfg.dim:
        cfg = dataclasses.replace(cfg, vocab_size=emb[0])  # vocabulary set by the data pipeline
    expected = _expected(cfg)
    missing = sorted(set(expected) - set(shapes) - ({"output.weight"} if cfg.tie_embeddings else set()))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        detail = f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
        raise ExportError(f"{source} is not a crosstrain GPT checkpoint ({detail}); only the built-in GPT exports")
    for name, shape in shapes.items():
        if shape != expected[name]:
            raise ExportError(f"{source}: {name} has shape {shape} but the model config expects {expected[name]}")
    return cfg


def _base_config(run_config: Path | None) -> dict[str, Any] | None:
    """The config.json of the folder a run was initialised from (``model.init_from``), when it still exists."""
    if run_config is None or not run_config.is_file():
        return None
    init_from = (json.loads(run_config.read_text()).get("model") or {}).get("init_from")
    from crosstrain.models.hf import is_hf_folder

    if init_from and is_hf_folder(init_from):  # not a crosstrain run dir, whose config.json is a run config
        from crosstrain.models.hf import read_hf_config

        return read_hf_config(init_from)
    return None


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
    base = _base_config(run_dir / "config.json" if run_dir else None)
    if set(shapes) - set(_expected(cfg)):  # e.g. LoRA adapters: the plugins' export hook needs the whole state
        from crosstrain.plugins.export.loading import load_checkpoint_dir

        loaded = load_checkpoint_dir(source)
        state = loaded.model.state_dict()
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        return WeightSource(_checked(loaded.config, shapes, str(ckpt)), loaded.tokenizer, loaded.source, shapes,
                            lambda names: {n: state[n] for n in names}, base)
    cfg = _checked(cfg, shapes, str(ckpt))
    return WeightSource(cfg, run_tokenizer(candidates, cfg), str(ckpt), shapes, tensors.load, base)


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
                        lambda names: {n: state[n] for n in names}, loaded.extra.get("hf_config"))


def _tokenizer_files(tokenizer: dict[str, Any], cfg: GPTConfig, out: Path) -> list[str]:
    if tokenizer.get("type") == "hf":
        from crosstrain.data.hf_tokenizer import TOKENIZER_FILES

        names = [n for n in TOKENIZER_FILES if (Path(tokenizer["path"]) / n).is_file()]
        for name in names:
            shutil.copyfile(Path(tokenizer["path"]) / name, out / name)
        return names
    if tokenizer.get("type") == "byte":
        from crosstrain.data.byte_level import write_byte_tokenizer

        return [p.name for p in write_byte_tokenizer(out, cfg.max_seq_len)]
    return []


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
              dtype: str = "float32", best: bool = False) -> dict[str, Any]:
    """Export ``source`` (with ``best``: a run's best checkpoint) as a Hugging Face folder ``out``; returns a
    report (files, shards, bytes, model_type)."""
    from crosstrain.models.hf import adapter_for, hf_config_from_gpt, parse_size, plan_shards, write_weights

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    out_path = Path(out).resolve()
    if out_path == Path(source).resolve():
        raise ExportError(f"--out {out_path} is the source folder; export into another folder")
    src = open_source(source, best=best)
    cfg, torch_dtype = src.config, DTYPES[dtype]
    hf_config = hf_config_from_gpt(cfg, base=src.base_config, dtype=dtype, eos_id=src.tokenizer.get("eos_id"))
    adapter = adapter_for(hf_config["model_type"])
    order = [n for n in _expected(cfg) if n in src.shapes and not (cfg.tie_embeddings and n == "output.weight")]
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    # one unit per HF tensor (a fused one, e.g. Phi-3's qkv_proj, gathers its crosstrain members)
    groups = {adapter.to_hf(g[0]): g for g in adapter.export_groups(order)}
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
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        files += ["config.json", *_tokenizer_files(src.tokenizer, cfg, tmp)]
        _replace_dir(tmp, out_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"path": str(out_path), "source": src.source, "model_type": hf_config["model_type"], "dtype": dtype,
            "shards": len(shards), "total_bytes": sum(s for _, s in sizes), "files": sorted(files),
            "tokenizer": src.tokenizer.get("type")}
