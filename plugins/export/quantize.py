"""Dynamic int8 quantization of an exported model with onnxruntime's quantization tools."""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path

from crosstrain.checkpoint.atomic import atomic_path
from crosstrain.plugins.export.errors import ExportError


def quantize_int8(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Write ``dst``: ``src`` with MatMul weights quantized to int8 (activations quantized per call).

    Metadata (model config, tokenizer) is carried over.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    dst_path = Path(dst)
    quiet = logging.getLogger("root").level
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            logging.getLogger().setLevel(logging.ERROR)
            quantize_dynamic(str(src), str(dst_path), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                             per_channel=False, extra_options={"MatMulConstBOnly": True})
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"int8 quantization failed: {first[:300]}") from exc
    finally:
        logging.getLogger().setLevel(quiet)
    src_meta = {p.key: p.value for p in onnx.load(str(src), load_external_data=False).metadata_props}
    model = onnx.load(str(dst_path))
    have = {p.key for p in model.metadata_props}
    for key, value in src_meta.items():
        if key not in have:
            model.metadata_props.add(key=key, value=value)
    model.metadata_props.add(key="crosstrain.quantization", value="int8-dynamic-matmul")
    with atomic_path(dst_path) as tmp:
        onnx.save(model, str(tmp))
    return dst_path
