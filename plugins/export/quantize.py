"""Dynamic int8 quantization of an exported model with onnxruntime's quantization tools, and the error handling
and metadata carry-over its static (vision) twin shares."""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from crosstrain.checkpoint.atomic import atomic_path
from crosstrain.plugins.export.errors import ExportError


@contextlib.contextmanager
def quantizer_errors(what: str) -> Iterator[None]:
    """onnxruntime.quantization's prints and warnings silenced; its failures become a one-line ExportError."""
    quiet = logging.getLogger().level
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            logging.getLogger().setLevel(logging.ERROR)
            yield
    except ExportError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"{what} failed: {first[:300]}") from exc
    finally:
        logging.getLogger().setLevel(quiet)


def quantize_int8(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Write ``dst``: ``src`` with MatMul weights quantized to int8 (activations quantized per call).

    Metadata (model config, tokenizer) is carried over.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    dst_path = Path(dst)
    with quantizer_errors("int8 quantization"):
        quantize_dynamic(str(src), str(dst_path), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                         per_channel=False, extra_options={"MatMulConstBOnly": True})
    carry_metadata(src, dst_path, "int8-dynamic-matmul")
    return dst_path


def carry_metadata(src: str | os.PathLike[str], dst: str | os.PathLike[str], quantization: str) -> None:
    """Rewrite ``dst`` (onnxruntime's quantized copy of ``src``) with ``src``'s ``metadata_props`` (model config,
    tokenizer, class names), which the quantizers drop, and ``crosstrain.quantization`` = ``quantization``."""
    import onnx

    src_meta = {p.key: p.value for p in onnx.load(str(src), load_external_data=False).metadata_props}
    model = onnx.load(str(dst))
    have = {p.key for p in model.metadata_props}
    for key, value in src_meta.items():
        if key not in have:
            model.metadata_props.add(key=key, value=value)
    model.metadata_props.add(key="crosstrain.quantization", value=quantization)
    with atomic_path(dst) as tmp:
        onnx.save(model, str(tmp))
