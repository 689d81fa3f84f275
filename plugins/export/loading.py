"""Load a trained GPT for export: from a run dir, a checkpoint folder (sharded ones are consolidated) or a
safetensors file, together with its model config and tokenizer metadata. Never unpickles anything."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from crosstrain.checkpoint.atomic import atomic_path
from crosstrain.checkpoint.consolidate import load_consolidated
from crosstrain.checkpoint.resolve import Resolved, resolve_path
from crosstrain.errors import CheckpointError
from crosstrain.models.gpt import GPT, PRESETS, GPTConfig
from crosstrain.models.hf.pretrained import read_json_object
from crosstrain.plugins.export.errors import ExportError

#: Metadata keys written into ONNX ``metadata_props`` and safetensors headers.
META_CONFIG = "crosstrain.gpt_config"
META_TOKENIZER = "crosstrain.tokenizer"
META_SOURCE = "crosstrain.source"
META_FORMAT = "crosstrain.export_format"
FORMAT_VERSION = "1"

_GPT_FIELDS = {f.name for f in dataclasses.fields(GPTConfig)}


@dataclass
class LoadedModel:
    """A GPT in eval mode on CPU (fp32) with the metadata an inference runtime needs."""

    model: GPT
    config: GPTConfig
    tokenizer: dict[str, Any]
    source: str
    extra: dict[str, Any] = field(default_factory=dict)


def tokenizer_metadata(cfg: GPTConfig) -> dict[str, Any]:
    """crosstrain trains on raw bytes: a 256-entry vocabulary is the byte tokenizer (token id == byte value)."""
    if cfg.vocab_size == 256:
        return {"type": "byte", "vocab_size": 256, "encoding": "utf-8", "bos_id": None, "eos_id": None}
    return {"type": "none", "vocab_size": cfg.vocab_size}


def gpt_config_from_dict(data: dict[str, Any], where: str = "config") -> GPTConfig:
    """A GPTConfig from a GPTConfig dict, a ``model`` config section (``preset`` + overrides) or a full run config."""
    if isinstance(data.get("model"), dict):
        data = data["model"]
    if data.get("init_from") and _hf_init_from(str(data["init_from"])):
        return _init_from_config(data, where)
    if data.get("init_from") and not data.get("import_path"):
        from crosstrain.models.gpt_family import origin_config
        from crosstrain.models.init_chain import init_origin

        origin = init_origin(str(data["init_from"]))  # another run's weights: that run's shape (and so on)
        if origin is not None and not origin.model.get("import_path"):
            cfg = origin_config(origin)
            return dataclasses.replace(cfg, max_seq_len=int(data["max_seq_len"])) if data.get("max_seq_len") else cfg
    if data.get("import_path"):
        raise ExportError(f"{where}: model.import_path={data['import_path']!r} is a user model; only the built-in "
                          "GPT can be exported (export it with torch.onnx yourself)")
    preset = data.get("preset")
    if preset is not None and preset not in PRESETS:
        raise ExportError(f"{where}: model.preset {preset!r} is not a built-in GPT preset ({', '.join(PRESETS)}); "
                          "only the built-in GPT can be exported")
    base = PRESETS[preset].to_dict() if preset else {}
    base.update({k: v for k, v in data.items() if k in _GPT_FIELDS and v is not None})
    if not base:
        raise ExportError(f"{where} holds no model description; it needs model.preset or GPTConfig fields")
    try:
        return GPTConfig(**base)
    except TypeError as exc:
        raise ExportError(f"{where}: invalid model config ({exc})") from exc


def _hf_init_from(path: str) -> bool:
    """``model.init_from`` names a Hugging Face folder (or one that is gone), not crosstrain weights (a run dir,
    checkpoint or .safetensors file, whose shape is the run's own ``model`` keys)."""
    from crosstrain.models.hf import is_hf_folder

    p = Path(path)
    return is_hf_folder(p) or not (p.exists() or p.suffix == ".safetensors")


def _init_from_config(model: dict[str, Any], where: str) -> GPTConfig:
    """A run trained from ``model.init_from``: the shape is that folder's config.json (+ ``max_seq_len``)."""
    from crosstrain.models.hf import pretrained_config

    folder = str(model["init_from"])
    if not Path(folder).is_dir():
        raise ExportError(f"{where}: model.init_from={folder!r} no longer exists, and the model's shape comes from "
                          "its config.json; restore that folder (or put a GPTConfig model_config.json next to the "
                          "checkpoint)")
    cfg = pretrained_config(folder)
    return dataclasses.replace(cfg, max_seq_len=int(model["max_seq_len"])) if model.get("max_seq_len") else cfg


def run_tokenizer(paths: list[Path], cfg: GPTConfig) -> dict[str, Any]:
    """The tokenizer of a run: ``data.tokenizer`` of the first run config among ``paths``, else the byte one."""
    for p in paths:
        if p.is_file():
            data = read_json_object(p, ExportError)
            spec = (data.get("data") or {}).get("tokenizer") if isinstance(data.get("data"), dict) else None
            if spec:
                from crosstrain.data.hf_tokenizer import describe_tokenizer

                if not (Path(spec) / "tokenizer.json").is_file():
                    return {"type": "none", "vocab_size": cfg.vocab_size, "missing": str(spec)}
                # serving renders chat as the run's data was (plugins/serve/chat.py)
                setting = str(data["data"].get("chat_template") or "auto")
                return {**describe_tokenizer(str(spec)), "chat_template": setting}
            break
    return tokenizer_metadata(cfg)


def load_hf_folder(folder: Path) -> LoadedModel:
    """A Hugging Face model folder (Llama, Mistral, Qwen2) with its tokenizer when it has a tokenizer.json."""
    from crosstrain.models.hf import load_pretrained, read_hf_config

    model = load_pretrained(folder).eval()
    tokenizer = tokenizer_metadata(model.config)
    if (folder / "tokenizer.json").is_file():
        from crosstrain.data.hf_tokenizer import describe_tokenizer

        tokenizer = describe_tokenizer(str(folder))
    return LoadedModel(model, model.config, tokenizer, str(folder), extra={"hf_config": read_hf_config(folder)})


def build_model(cfg: GPTConfig, state: dict[str, torch.Tensor], source: str,
                transform: Callable[[GPT], GPT] | None = None) -> GPT:
    """A fp32 eval-mode GPT holding ``state`` (plain GPT parameter names; common wrapper prefixes stripped).

    ``transform`` rebuilds what plugins changed in training (MoE layers) before the weights are loaded.
    """
    state = _strip_prefixes(state)
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items() if not k.startswith("rope_")}
    if cfg.tie_embeddings and "output.weight" not in state and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    emb = state.get("tok_embeddings.weight")
    if emb is not None and emb.ndim == 2 and emb.shape[0] != cfg.vocab_size and emb.shape[1] == cfg.dim:
        cfg = dataclasses.replace(cfg, vocab_size=int(emb.shape[0]))  # vocab set by the data pipeline
    try:
        model = GPT(cfg)
    except ValueError as exc:
        raise ExportError(f"{source}: unsupported model config ({exc})") from exc
    if transform is not None:
        model = transform(model)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        detail = f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
        raise ExportError(f"{source} is not a crosstrain GPT checkpoint ({detail}, {len(missing)} missing, "
                          f"{len(unexpected)} unexpected keys); only the built-in GPT can be exported")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ExportError(f"{source}: {name} has shape {tuple(state[name].shape)} but the model config expects "
                              f"{tuple(tensor.shape)}; fix the config next to the checkpoint")
    model.load_state_dict(state, strict=True)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval()


def _strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for prefix in ("model.", "module.", "_orig_mod."):
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return {k.replace("._checkpoint_wrapped_module", "").replace("_orig_mod.", ""): v for k, v in state.items()}


# -- checkpoints --------------------------------------------------------------------------------------------------
def _config_near(paths: list[Path], where: str) -> GPTConfig:
    for p in paths:
        if p.is_file():
            return gpt_config_from_dict(read_json_object(p, ExportError), str(p))
    raise ExportError(f"no model config found for {where} (looked for {', '.join(str(p) for p in paths)}); "
                      "put the run's config.json next to it")


def load_checkpoint_dir(source: Resolved) -> LoadedModel:
    """A resolved checkpoint (any layout, consolidated) with the model config beside it or in its run dir."""
    ckpt, run_dir = source.path, source.run_dir
    config = run_config(run_dir)
    state = export_state_dict(load_consolidated(source), config)
    candidates = [ckpt / "config.json", ckpt / "model_config.json"]
    if run_dir is not None:
        candidates.append(run_dir / "config.json")
    cfg = _config_near(candidates, str(ckpt))
    model = build_model(cfg, state, str(ckpt), transform=_training_transforms(config))
    return LoadedModel(model, model.config, run_tokenizer(candidates, model.config), str(ckpt))


def run_config(run_dir: Path | None) -> Any:
    """The run's own :class:`crosstrain.config.Config` (``config.toml``), or None without a readable one."""
    if run_dir is None or not (run_dir / "config.toml").is_file():
        return None
    from crosstrain.config import load_config
    from crosstrain.errors import ConfigError

    try:
        return load_config(run_dir / "config.toml", [])
    except ConfigError:  # written under other plugins: a plain GPT still loads (and a changed one says so)
        return None


def export_state_dict(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """``state`` after every plugin's ``crosstrain_export_state_dict`` (e.g. LoRA adapters merged into plain
    weights); a copy, so the caller's dict is unchanged."""
    from crosstrain import pluginmanager

    out = dict(state)
    pluginmanager.call_strict("crosstrain_export_state_dict", "prepare the weights for export", state_dict=out,
                              config=config)
    return out


def _training_transforms(config: Any) -> Callable[[GPT], GPT] | None:
    """The plugins' ``crosstrain_transform_model`` chain under the run's own config, as training applied it
    (e.g. the MoE plugin's layers), or None without a run config."""
    if config is None:
        return None
    from crosstrain.engine.models import transform_model

    return lambda model: cast(GPT, transform_model(model, "model", config))


# -- safetensors files --------------------------------------------------------------------------------------------
def load_safetensors_file(path: Path) -> LoadedModel:
    """A GPT state_dict in safetensors; its config from the file's metadata or a JSON file next to it."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            state = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc
    if META_CONFIG in meta:
        cfg = gpt_config_from_dict(json.loads(meta[META_CONFIG]), f"{path} metadata")
    else:
        cfg = _config_near([path.with_suffix(".json"), path.parent / "config.json", path.parent.parent / "config.json"],
                           str(path))
    model = build_model(cfg, state, str(path))
    tokenizer = json.loads(meta[META_TOKENIZER]) if META_TOKENIZER in meta else tokenizer_metadata(model.config)
    return LoadedModel(model, model.config, tokenizer, str(path))


def load_model(path: str | os.PathLike[str] | Resolved, *, best: bool = False, what: str = "") -> LoadedModel:
    """Load what ``path`` points to (:func:`~crosstrain.checkpoint.resolve.resolve_path`): a run dir (its newest
    checkpoint, or with ``best`` its best one), a ``checkpoints/`` folder, one checkpoint, a .safetensors file or
    a Hugging Face model folder (config.json with a model_type + safetensors). ``what`` names ``path`` in errors
    (a config key)."""
    if not isinstance(path, Resolved) and Path(path).suffix == ".onnx" and Path(path).is_file():
        raise ExportError(f"{path} is already an ONNX model; export needs a run dir, checkpoint or .safetensors file")
    from crosstrain.plugins.export import hf_generic

    source = resolve_path(path, best=best, what=what)
    if source.kind == "safetensors":
        return load_safetensors_file(source.path)
    if source.kind == "hf":
        if hf_generic.is_generic_folder(source.path):
            return hf_generic.load_generic_folder(source.path)
        return load_hf_folder(source.path)
    generic = hf_generic.generic_config(source)
    if generic is not None:
        return hf_generic.load_generic_checkpoint(source, generic)
    return load_checkpoint_dir(source)


def save_safetensors(loaded: LoadedModel, out: str | os.PathLike[str]) -> Path:
    """Write the model as one safetensors file with config + tokenizer metadata (temp file, then rename)."""
    from safetensors.torch import load_file, save_file

    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in loaded.model.state_dict().items()}
    if loaded.config.tie_embeddings:
        state.pop("output.weight", None)
    meta = {META_CONFIG: json.dumps(loaded.config.to_dict()), META_TOKENIZER: json.dumps(loaded.tokenizer),
            META_SOURCE: loaded.source, META_FORMAT: FORMAT_VERSION}
    with atomic_path(out_path) as tmp:
        save_file(state, str(tmp), metadata=meta)
        back = load_file(str(tmp))
        bad = [k for k, v in state.items() if not torch.equal(back[k], v)]
        if bad:
            raise ExportError(f"safetensors round trip changed {bad[0]}; nothing written")
    return out_path
