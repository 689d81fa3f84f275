"""``crosstrain export --format hf`` and ``crosstrain generate`` for runs on the generic (transformers) path.

The checkpoint's tensors already have transformers' names; :mod:`crosstrain.models.generic.export` rebuilds the
run's model and writes it with ``save_pretrained``. A Hugging Face folder whose ``model_type`` no native family
imports loads on the generic path too (generation, ``--format hf`` export).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.resolve import Resolved, resolve_path
from crosstrain.plugins.export.errors import ExportError


def generic_config(source: Resolved) -> Any:
    """The run config of a checkpoint trained on the generic path, else None."""
    if source.kind != "checkpoint":
        return None
    from crosstrain.models.generic.export import is_generic_run
    from crosstrain.plugins.export.loading import run_config

    config = run_config(source.run_dir)
    return config if is_generic_run(config) else None


def is_generic_folder(folder: Path) -> bool:
    """A Hugging Face folder of a model_type no native family imports."""
    from crosstrain.models.family import native_model_types
    from crosstrain.models.hf import read_hf_config

    return str(read_hf_config(folder).get("model_type")) not in native_model_types()


def load_generic_checkpoint(source: Resolved, config: Any) -> Any:
    """A :class:`~crosstrain.plugins.export.loading.LoadedModel` of a generic run's checkpoint."""
    from crosstrain.checkpoint.consolidate import load_consolidated
    from crosstrain.models.generic.config import config_from_run
    from crosstrain.models.generic.export import load_generic
    from crosstrain.plugins.export.loading import LoadedModel, export_state_dict, run_tokenizer

    cfg = config_from_run(config)
    state = export_state_dict(load_consolidated(source), config)
    try:
        model = load_generic(config, state, str(source.path))
    except Exception as exc:  # a scalar-head (rm) checkpoint, a changed init_from folder
        raise ExportError(str(exc).splitlines()[0]) from None
    candidates = [source.run_dir / "config.json"] if source.run_dir is not None else []
    return LoadedModel(model, cfg, run_tokenizer(candidates, cfg), str(source.path))  # type: ignore[arg-type]


def load_generic_folder(folder: Path) -> Any:
    """A Hugging Face folder on the generic path, with its tokenizer when it has a tokenizer.json."""
    from crosstrain.models.generic.build import build
    from crosstrain.models.generic.config import GenericConfig, config_length
    from crosstrain.models.hf import read_hf_config
    from crosstrain.plugins.export.loading import LoadedModel, tokenizer_metadata

    hf_config = read_hf_config(folder)
    cfg = GenericConfig(hf_config=hf_config, init_from=str(folder), max_seq_len=config_length(hf_config))
    tokenizer = tokenizer_metadata(cfg)  # type: ignore[arg-type]
    if (folder / "tokenizer.json").is_file():
        from crosstrain.data.hf_tokenizer import describe_tokenizer

        tokenizer = describe_tokenizer(str(folder))
    return LoadedModel(build(cfg).eval(), cfg, tokenizer, str(folder), extra={"hf_config": hf_config})  # type: ignore[arg-type]


def export_generic(source: str | os.PathLike[str], out: Path, *, max_shard_size: str | int, dtype: str,
                   best: bool) -> dict[str, Any] | None:
    """Export a generic run's checkpoint, or a Hugging Face folder of a model_type no native family imports, with
    ``save_pretrained``; None when ``source`` is neither."""
    from crosstrain.models.generic.export import save_hf
    from crosstrain.plugins.export.hf_export import DTYPES, _replace_dir, origin_folder
    from crosstrain.plugins.export.hf_generation import write_generation_files

    resolved = resolve_path(source, best=best)
    if resolved.kind == "hf" and is_generic_folder(resolved.path):
        loaded, origin = load_generic_folder(resolved.path), resolved.path
    else:
        config = generic_config(resolved)
        if config is None:
            return None
        loaded = load_generic_checkpoint(resolved, config)
        origin = origin_folder(resolved.run_dir / "config.json") if resolved.run_dir is not None else None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        files = save_hf(loaded.model, tmp, dtype=DTYPES[dtype], max_shard_size=max_shard_size)
        files = sorted({*files, *write_generation_files(loaded.tokenizer, origin, loaded.config, tmp)})
        shards = [f for f in files if f.endswith(".safetensors")]
        total = sum((tmp / f).stat().st_size for f in shards)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"path": str(out), "source": loaded.source, "model_type": loaded.config.model_type, "dtype": dtype,
            "shards": len(shards), "total_bytes": total, "files": sorted(files),
            "tokenizer": loaded.tokenizer.get("type"), "path_kind": "generic"}


def refuse_native_only(loaded: Any, fmt: str) -> None:
    """ONNX and crosstrain safetensors exports are of the native GPT; say so for a generic model."""
    from crosstrain.models.generic.wrapper import GenericCausalLM

    if isinstance(loaded.model, GenericCausalLM):
        raise ExportError(f"--format {fmt} exports crosstrain's native GPT; a model on the generic (transformers) "
                          "path exports with --format hf")
