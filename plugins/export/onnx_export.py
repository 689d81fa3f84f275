"""Export the built-in GPT to ONNX with an explicit KV cache.

One graph serves prefill and decode: inputs ``input_ids [batch, seq]`` and, per layer, ``past_key_values.{i}.key``
/ ``.value`` ``[batch, kv_heads, past, head_dim]`` (``past`` may be 0 for the prefill); outputs ``logits
[batch, seq, vocab]`` and ``present.{i}.key`` / ``.value`` ``[batch, kv_heads, past + seq, head_dim]``. Batch,
sequence and past axes are dynamic. The model config and tokenizer live in the ONNX ``metadata_props``.
Kernel-registry ops trace through their reference implementations.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from crosstrain.checkpoint.atomic import disk_errors
from crosstrain.kernels import registry as kernel_registry
from crosstrain.models.gpt import GPT, GPTConfig
from crosstrain.plugins.export.defaults import DEFAULT_INT8_TOLERANCE, DEFAULT_TOLERANCE
from crosstrain.plugins.export.errors import ExportError
from crosstrain.plugins.export.loading import (
    FORMAT_VERSION,
    META_CONFIG,
    META_FORMAT,
    META_SOURCE,
    META_TOKENIZER,
    LoadedModel,
)
from crosstrain.plugins.export.parity import ParityReport

META_IO = "crosstrain.io"


def input_names(cfg: GPTConfig) -> list[str]:
    return ["input_ids"] + [f"past_key_values.{i}.{kv}" for i in range(cfg.n_layers) for kv in ("key", "value")]


def output_names(cfg: GPTConfig) -> list[str]:
    return ["logits"] + [f"present.{i}.{kv}" for i in range(cfg.n_layers) for kv in ("key", "value")]


class ExportModule(nn.Module):
    """A GPT with flat tensors in and out: ``(input_ids, k0, v0, k1, v1, ...) -> (logits, k0', v0', ...)``."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        if gpt.tok_embeddings is None or gpt.output is None or gpt.norm is None:
            raise ExportError("only a whole GPT can be exported (this one is a pipeline stage); consolidate it first")
        self.gpt = gpt
        self.n_layers = gpt.config.n_layers

    def forward(self, input_ids: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache = [(past[2 * i], past[2 * i + 1]) for i in range(self.n_layers)]
        logits, presents = self.gpt.forward_with_cache(input_ids, cache)
        flat: list[torch.Tensor] = [logits]
        for k, v in presents:
            flat += [k, v]
        return tuple(flat)


def example_inputs(cfg: GPTConfig, batch: int = 2, seq: int = 5, past: int = 3) -> tuple[torch.Tensor, ...]:
    """Example inputs for tracing; sizes >= 2 and distinct so no dynamic axis is specialised."""
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), dtype=torch.long)
    cache = [torch.randn(batch, cfg.kv_heads, past, cfg.head_dim) for _ in range(2 * cfg.n_layers)]
    return (ids, *cache)


def _dynamic_shapes(cfg: GPTConfig) -> dict[str, Any]:
    from torch.export import Dim

    batch = Dim("batch", min=1, max=4096)
    seq = Dim("seq", min=1, max=cfg.max_seq_len)
    past = Dim("past", min=0, max=cfg.max_seq_len)
    return {"input_ids": {0: batch, 1: seq}, "past": tuple({0: batch, 2: past} for _ in range(2 * cfg.n_layers))}


def metadata(loaded: LoadedModel, extra: dict[str, str] | None = None) -> dict[str, str]:
    meta = {
        META_CONFIG: json.dumps(loaded.config.to_dict()),
        META_TOKENIZER: json.dumps(loaded.tokenizer),
        META_SOURCE: loaded.source,
        META_FORMAT: FORMAT_VERSION,
        META_IO: json.dumps({"inputs": input_names(loaded.config), "outputs": output_names(loaded.config),
                             "kv_layout": "batch,kv_heads,past,head_dim", "past_may_be_empty": True}),
    }
    meta.update(extra or {})
    return meta


@contextlib.contextmanager
def _quiet() -> Any:
    """Silence the exporter's progress prints and warnings (errors still raise)."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def trace_to_onnx(model: GPT, path: Path, meta: dict[str, str], *, opset: int | None = None) -> None:
    """Trace ``model`` (reference kernels only) and save the ONNX graph with ``meta`` at ``path``."""
    wrapper = ExportModule(model).eval()
    cfg = model.config
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    args = example_inputs(cfg)
    torch.random.set_rng_state(gen_state)
    try:
        with kernel_registry.use_reference(), torch.no_grad(), _quiet():
            program = torch.onnx.export(wrapper, args, dynamo=True, dynamic_shapes=_dynamic_shapes(cfg),
                                        input_names=input_names(cfg), output_names=output_names(cfg),
                                        opset_version=opset, verbose=False, optimize=True)
    except Exception as exc:
        raise ExportError(f"torch.onnx.export failed for this model: {root_cause(exc)}") from exc
    if program is None:
        raise ExportError("torch.onnx.export returned no program")
    program.model.metadata_props.update(meta)
    big = sum(p.numel() * p.element_size() for p in model.parameters()) > 1_800_000_000
    with _quiet(), disk_errors(path):
        program.save(str(path), external_data=big)


def root_cause(exc: BaseException) -> str:
    """One line describing the innermost cause of ``exc``."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


@dataclass
class ExportReport:
    """What an export wrote and how close it is to PyTorch."""

    path: str
    parity: ParityReport
    int8_path: str | None = None
    int8_parity: ParityReport | None = None
    files: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"wrote {self.path}", f"parity fp32: {self.parity.describe()}"]
        if self.int8_path and self.int8_parity is not None:
            out += [f"wrote {self.int8_path}", f"parity int8: {self.int8_parity.describe()}"]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "parity": self.parity.to_dict(), "int8_path": self.int8_path,
                "int8_parity": None if self.int8_parity is None else self.int8_parity.to_dict()}


def int8_path_for(out: Path) -> Path:
    return out.with_name(out.stem + ".int8" + out.suffix)


def check_onnx_out(out: Path) -> None:
    """Refuse an ``--out`` that is a folder or does not end in ``.onnx``, before anything is written."""
    if out.suffix != ".onnx" or out.is_dir():
        raise ExportError(f"--out {out} must be a file path ending in .onnx")


@contextlib.contextmanager
def staging(out: Path, tag: str = "") -> Iterator[Path]:
    """A fresh folder beside ``out`` (same filesystem, so :func:`_publish` renames), removed on exit whatever
    happens: an export writes and gates there and publishes only what passed, so a failure leaves nothing."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out.name}.{tag + '.' if tag else ''}", dir=out.parent))
    try:
        yield tmp_dir
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _publish(tmp_dir: Path, name: str, out_dir: Path) -> list[str]:
    """Move ``name`` and its external-data files from ``tmp_dir`` into ``out_dir``, the model file last."""
    moved = []
    for f in sorted(tmp_dir.iterdir()):
        if f.name != name:
            os.replace(f, out_dir / f.name)
            moved.append(str(out_dir / f.name))
    os.replace(tmp_dir / name, out_dir / name)
    return [*moved, str(out_dir / name)]


def export_onnx(
    loaded: LoadedModel,
    out: str | os.PathLike[str],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    int8: bool = False,
    int8_tolerance: float = DEFAULT_INT8_TOLERANCE,
    opset: int | None = None,
    seed: int = 0,
) -> ExportReport:
    """Export to ``out`` and verify it against PyTorch; on any failure nothing is left at ``out``.

    With ``int8`` also writes ``<out stem>.int8.onnx`` (dynamic int8 quantization) with its own parity report.
    """
    from crosstrain.plugins.export.parity import check_parity

    out_path = Path(out)
    if out_path.suffix != ".onnx":
        raise ExportError(f"--out {out_path} must end in .onnx")
    if out_path.is_dir():
        raise ExportError(f"--out {out_path} is a folder; give a file path ending in .onnx")
    model = loaded.model.eval()
    with contextlib.ExitStack() as stack:
        tmp_dir = stack.enter_context(staging(out_path))
        tmp_model = tmp_dir / out_path.name
        trace_to_onnx(model, tmp_model, metadata(loaded), opset=opset)
        parity = check_parity(model, tmp_model, tolerance=tolerance, seed=seed, label="fp32")
        report = ExportReport(str(out_path), parity)
        q_dir: Path | None = None  # the int8 file's own folder: _publish moves every file of a folder
        if int8:
            from crosstrain.plugins.export.quantize import quantize_int8

            q_dir = stack.enter_context(staging(out_path, "int8"))
            q_path = q_dir / int8_path_for(out_path).name
            quantize_int8(tmp_model, q_path)
            report.int8_parity = check_parity(model, q_path, tolerance=int8_tolerance, seed=seed, label="int8")
            report.int8_path = str(int8_path_for(out_path))
        report.files = _publish(tmp_dir, out_path.name, out_path.parent)
        if q_dir is not None:
            report.files += _publish(q_dir, int8_path_for(out_path).name, out_path.parent)
        return report
