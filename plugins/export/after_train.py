"""``export.onnx = true`` / ``export.safetensors = true``: export when training ends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from crosstrain.checkpoint.atomic import atomic_write

#: Attributes of the training context that may hold the (parallelised) model, most specific first.
_MODEL_ATTRS = ("parallel_model", "pmodel", "model")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def full_state_dict(context: Any) -> dict[str, torch.Tensor] | None:
    """The full model state from the training context (a collective on every rank for sharded models)."""
    final = getattr(context, "final_state_dict", None)  # the Trainer gathers it once after the last step
    if isinstance(final, dict) and final:
        return final
    for attr in _MODEL_ATTRS:
        obj = getattr(context, attr, None)
        if obj is None:
            continue
        if callable(getattr(obj, "full_state_dict", None)):
            return obj.full_state_dict()
        if isinstance(obj, torch.nn.Module):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                continue  # a local shard: fall back to the checkpoint
            return {k: v.detach().to("cpu") for k, v in obj.state_dict().items()}
    return None


def export_after_train(context: Any, run_dir: str) -> dict[str, Any] | None:
    """Export the trained model into ``<run_dir>/<export.dir>`` as configured; returns the report (rank 0)."""
    config = getattr(context, "config", None)
    if config is None or not hasattr(config, "section"):
        return None
    try:
        section = config.section("export")
    except KeyError:
        return None
    if not (section.onnx or section.safetensors):
        return None
    state = full_state_dict(context)  # every rank takes part in the gather
    if _rank() != 0:
        return None
    from crosstrain.models.gpt import GPTConfig
    from crosstrain.plugins.export.loading import (
        LoadedModel,
        build_model,
        export_state_dict,
        gpt_config_from_dict,
        load_model,
        save_safetensors,
        tokenizer_metadata,
    )

    if state is None:
        loaded = load_model(run_dir)
    else:
        state = export_state_dict(state, config)
        gpt_cfg = getattr(context, "model_config", None)
        if not isinstance(gpt_cfg, GPTConfig):
            cfg_dict = config.to_dict() if hasattr(config, "to_dict") else {}
            gpt_cfg = gpt_config_from_dict(cfg_dict, "training config")
        model = build_model(gpt_cfg, state, str(run_dir))
        loaded = LoadedModel(model, model.config, tokenizer_metadata(model.config), str(run_dir))
    out_dir = Path(run_dir) / section.dir
    report: dict[str, Any] = {}
    if section.safetensors:
        report["safetensors"] = str(save_safetensors(loaded, out_dir / "model.safetensors"))
    if section.onnx:
        from crosstrain.plugins.export.onnx_export import export_onnx

        result = export_onnx(loaded, out_dir / "model.onnx", tolerance=section.tolerance, int8=section.int8,
                             int8_tolerance=section.int8_tolerance, opset=section.opset)
        report["onnx"] = result.to_dict()
        for line in result.lines():
            print(f"export: {line}", flush=True)
    atomic_write(out_dir / "export.json", json.dumps(report, indent=2))
    return report
