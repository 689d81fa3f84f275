"""A served model version: the weights loaded from one checkpoint (or file), its engine's batch, and what
``/v1/models`` reports about it (step, params SHA-256, loaded-at, the gate's verdict)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.resolve import Resolved, resolve_path
from crosstrain.errors import ConfigError
from crosstrain.plugins.export.placement import HOST, Placement, inference_placement
from crosstrain.plugins.serve.gate import GateReport, check


class Codec:
    """Text <-> token ids for one tokenizer description (``crosstrain generate``'s ``encode``/``decode``), with a
    Hugging Face tokenizer built once, not per call (a stream decodes after every token)."""

    def __init__(self, tokenizer: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self._hf: Any = None
        if tokenizer.get("type") == "hf":
            from crosstrain.data.hf_tokenizer import HFTokenizer

            self._hf = HFTokenizer(tokenizer["path"])

    def encode(self, text: str) -> list[int]:
        from crosstrain.plugins.export.generate import encode

        return [int(i) for i in self._hf.encode(text)] if self._hf is not None else encode(self.tokenizer, text)

    def decode(self, ids: list[int]) -> str:
        from crosstrain.plugins.export.generate import decode

        return str(self._hf.decode(ids)) if self._hf is not None else decode(self.tokenizer, ids)


@dataclass(eq=False)
class Version:
    number: int
    source: str
    step: int | None
    params_sha256: str | None
    engine: str
    batch: Any  # ContinuousBatch (torch) or OrtBatch (onnxruntime)
    tokenizer: dict[str, Any]
    context: int
    vocab: int
    gate: GateReport
    placement: Placement = HOST  # where the engine computes (and the requests' sampling generators live)
    loaded_at: float = field(default_factory=time.time)
    codec: Codec = field(init=False)

    def __post_init__(self) -> None:
        self.codec = Codec(self.tokenizer)

    def describe(self) -> dict[str, Any]:
        return {"version": self.number, "source": self.source, "step": self.step,
                "params_sha256": self.params_sha256, "loaded_at": self.loaded_at, "engine": self.engine,
                "context_length": self.context, "backend": self.placement.backend,
                "device": str(self.placement.device), "gate": self.gate.to_dict()}


def _consolidated(resolved: Resolved) -> dict[str, Any]:
    from crosstrain.checkpoint.consolidate import load_consolidated

    return load_consolidated(resolved, check=False)  # load_model verified it


def load_version(source: str | Resolved, number: int, engine: str, max_batch: int, workdir: Path,
                 best: bool = False) -> Version:
    """Load and gate one version (raises the loaders' one-line errors; a failed gate is in ``version.gate``)."""
    from crosstrain.plugins.export.generate import OrtEngine
    from crosstrain.plugins.export.runtime import is_onnx

    if not isinstance(source, Resolved) and is_onnx(source):
        if engine != "onnxruntime":
            raise ConfigError(f"{source} is an ONNX file; serve it with --engine onnxruntime")
        if not Path(source).is_file():
            raise ConfigError(f"{source} does not exist; export one with `crosstrain export ... --format onnx`")
        ort = OrtEngine(source)
        from crosstrain.plugins.serve.ort_batch import OrtBatch

        return Version(number, str(source), None, None, engine, OrtBatch(ort, max_batch), ort.tokenizer,
                       ort.config.max_seq_len, ort.config.vocab_size, check(None, ort, None, None))
    from crosstrain.engine.state import params_sha256
    from crosstrain.generation import ContinuousBatch
    from crosstrain.plugins.export.loading import load_model

    resolved = source if isinstance(source, Resolved) else resolve_path(source, best=best)
    loaded = load_model(resolved)
    # a checkpoint's hash is summary.json's: of the trained tensors (LoRA adapters unmerged), not the merged model
    sha = params_sha256(_consolidated(resolved) if resolved.kind == "checkpoint" else loaded.model.state_dict())
    step, run_dir = resolved.step, resolved.run_dir
    placement = HOST if engine == "onnxruntime" else inference_placement()
    model = loaded.model.to(placement.device).eval()  # a hot update loads onto the device the server runs on
    ort = None
    if engine == "onnxruntime":
        from crosstrain.plugins.export.onnx_export import export_onnx

        report = export_onnx(loaded, workdir / f"v{number}.onnx")  # raises ParityError if it disagrees with torch
        ort = OrtEngine(report.path)
        from crosstrain.plugins.serve.ort_batch import OrtBatch

        batch: Any = OrtBatch(ort, max_batch)
    else:
        batch = ContinuousBatch(model, max_batch)
    gate = check(model, ort, run_dir, step)
    return Version(number, loaded.source, step, sha, engine, batch, loaded.tokenizer, model.config.max_seq_len,
                   model.config.vocab_size, gate, placement)

