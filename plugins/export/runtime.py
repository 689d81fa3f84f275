"""onnxruntime sessions and the crosstrain metadata stored in an exported model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from crosstrain.models.gpt import GPTConfig
from crosstrain.plugins.export.errors import ExportError
from crosstrain.plugins.export.loading import META_CONFIG, META_TOKENIZER, gpt_config_from_dict


def make_session(path: str | os.PathLike[str], threads: int | None = None) -> Any:
    """A CPU onnxruntime session with full graph optimisation (``threads`` intra-op threads; None = default)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 4  # errors are re-raised as one-line ExportErrors
    # files of earlier releases held int4 weights as DequantizeLinear + MatMul, which onnxruntime fuses into
    # MatMulNBits at a default accuracy level that re-quantises their activations; 0 keeps what they were checked
    # against. Today's integer exports set accuracy_level=4 on their own MatMulNBits nodes (int_reference.py)
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    if threads is not None:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"onnxruntime cannot load {path}: {first[:300]}") from exc


def read_metadata(session: Any) -> tuple[GPTConfig, dict[str, Any]]:
    """The GPT config and tokenizer description stored by :func:`~crosstrain.plugins.export.onnx_export.export_onnx`."""
    props = session.get_modelmeta().custom_metadata_map
    if META_CONFIG not in props:
        raise ExportError("this ONNX model was not exported by crosstrain (no crosstrain.gpt_config metadata); "
                          "re-export it with `crosstrain export`")
    cfg = gpt_config_from_dict(json.loads(props[META_CONFIG]), "ONNX metadata")
    tokenizer = json.loads(props.get(META_TOKENIZER, "{}")) or {"type": "none", "vocab_size": cfg.vocab_size}
    return cfg, tokenizer


def run(session: Any, feeds: dict[str, Any]) -> list[Any]:
    """``session.run`` with onnxruntime failures (bad shapes, corrupt graphs) turned into a one-line ExportError."""
    try:
        return session.run(None, feeds)
    except Exception as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        raise ExportError(f"onnxruntime failed to run the model: {lines[0][:300] if lines else type(exc).__name__}; "
                          "check the input shapes (past + seq must fit max_seq_len)") from exc


def is_onnx(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix == ".onnx"
