"""Build the built-in GPT from a Hugging Face model folder (``model.init_from = HF_DIR``).

The GPT's shape comes from ``config.json`` (:func:`~crosstrain.models.hf.config.gpt_config_from_hf`); weights
are copied tensor by tensor through the family's adapter, so the model is never held twice. Every GPT parameter
must be found with its exact shape, and every HF weight must be used, else a one-line error names the first one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from crosstrain.errors import ConfigError, CrosstrainError
from crosstrain.models.gpt import GPT, GPTConfig
from crosstrain.models.hf.adapter import adapter_for
from crosstrain.models.hf.config import gpt_config_from_hf
from crosstrain.models.hf.weights import iter_tensors


def is_hf_folder(path: str | os.PathLike[str]) -> bool:
    """A folder with a ``config.json`` that names a ``model_type`` (what ``save_pretrained`` writes)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "model_type" in data


def read_hf_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model.init_from {str(folder)!r} has no config.json; point it at a Hugging Face model "
                          "folder (config.json + *.safetensors)")
    return read_json_object(path)


def read_json_object(path: str | os.PathLike[str], error: type[CrosstrainError] = ConfigError) -> dict[str, Any]:
    """The JSON object in ``path``, or ``error`` with a one-line message when it is unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise error(f"{path} is not valid JSON ({exc}); fix or regenerate it") from None
    if not isinstance(data, dict):
        raise error(f"{path} is not a JSON object; fix or regenerate it")
    return data


def pretrained_config(folder: str | os.PathLike[str], **overrides: Any) -> GPTConfig:
    """The GPTConfig of an HF folder, with ``overrides`` (e.g. a shorter ``max_seq_len``) applied."""
    cfg = gpt_config_from_hf(read_hf_config(folder), str(Path(folder) / "config.json"))
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


@torch.no_grad()
def load_hf_weights(model: GPT, folder: str | os.PathLike[str]) -> None:
    """Copy the HF folder's weights into ``model`` (converted to the parameters' dtype), checking every name."""
    adapter = adapter_for(str(read_hf_config(folder)["model_type"]))
    params = model.state_dict(keep_vars=True)
    seen: set[str] = set()
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    for hf_name, tensor in iter_tensors(folder):
        try:
            pieces = adapter.from_hf_tensor(hf_name, tensor, shapes)
        except KeyError as exc:
            raise ConfigError(f"{folder}: {exc.args[0]}; only {adapter.family} checkpoints without extra modules "
                              "can be imported") from None
        for name, piece in pieces:  # several for a fused tensor (Phi-3's qkv_proj), none for a skipped key
            if name not in params:
                raise ConfigError(f"{folder}: weight {hf_name!r} has no place in the GPT built from its config.json "
                                  f"({name!r}); the config and the weights disagree")
            target = params[name]
            if tuple(piece.shape) != tuple(target.shape):
                raise ConfigError(f"{folder}: {hf_name} has shape {tuple(tensor.shape)}, but config.json gives "
                                  f"{tuple(target.shape)}")
            target.copy_(piece)
            seen.add(name)
    tied = {"output.weight"} if model.config.tie_embeddings else set()
    missing = sorted(set(params) - seen - tied)
    if missing:
        raise ConfigError(f"{folder} lacks {adapter.to_hf(missing[0])!r} ({len(missing)} GPT weights missing); "
                          "the checkpoint is incomplete")


def load_pretrained(folder: str | os.PathLike[str], **overrides: Any) -> GPT:
    """A GPT built from the HF folder's config.json (plus ``overrides``) holding its weights."""
    model = GPT(pretrained_config(folder, **overrides))
    load_hf_weights(model, folder)
    return model
