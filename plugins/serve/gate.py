"""The gate a new model version passes before it serves: its weights give finite logits, the serving engine
agrees with the model's own training forward on fixed prompts, and the eval loss the run recorded for its step
(if any) is finite. A version that fails is never served (the server logs why and keeps the old one)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crosstrain.generation.sharded import model_device
from crosstrain.generation.slots import SlotKVCache

#: fixed prompts (bytes; ids are taken modulo the vocabulary for other tokenizers)
GATE_PROMPTS = ("Hello", "The quick brown fox", "crosstrain serve")
#: max abs logit error between the engine and the training forward (fp32; the export parity check's default)
TOLERANCE = 1e-4


@dataclass
class GateReport:
    passed: bool
    reason: str
    max_abs_err: float | None
    eval_loss: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gate_prompts(vocab: int) -> list[list[int]]:
    return [[b % vocab for b in p.encode()] for p in GATE_PROMPTS]


@torch.no_grad()
def torch_engine_logits(model: Any, prompts: list[list[int]]) -> torch.Tensor:
    """Last-token logits ``[len(prompts), vocab]`` through the serving path: each prompt but its last token
    prefilled alone, then all last tokens decoded in one step of a :class:`SlotKVCache` (rows of mixed lengths)."""
    device = model_device(model)
    cache = SlotKVCache(len(model.blocks()), len(prompts), int(model.config.max_seq_len))
    for p in prompts:
        prefill = model.allocate_kv_cache(1, len(p) - 1, None, device)
        model.forward_cached(torch.tensor([p[:-1]], device=device), torch.arange(len(p) - 1, device=device)[None],
                             prefill, None)
        cache.admit(prefill)
    last = torch.tensor([[p[-1]] for p in prompts], device=device)
    return model.forward_cached(last, cache.positions(device), cache, None)[:, -1].float()


def ort_engine_logits(engine: Any, prompts: list[list[int]]) -> torch.Tensor:
    """The same through onnxruntime: a prefill of all but the last token, then one decode step with its cache."""
    rows = []
    for p in prompts:
        _, past = engine.forward(np.asarray([p[:-1]], dtype=np.int64), engine.empty_cache(1))
        logits, _ = engine.forward(np.asarray([p[-1:]], dtype=np.int64), past)
        rows.append(torch.from_numpy(np.ascontiguousarray(logits[:, -1])))
    return torch.cat(rows).float()


@torch.no_grad()
def reference_logits(model: Any, prompts: list[list[int]]) -> torch.Tensor:
    """The training forward (``GPT.forward``, no cache) on each whole prompt: the last position's logits."""
    device = model_device(model)
    return torch.cat([model(torch.tensor([p], device=device))[:, -1].float() for p in prompts])


def recorded_eval_loss(run_dir: Path | None, step: int | None) -> tuple[bool, float | None]:
    """``(found, value)`` of the last ``eval/loss`` the run's metrics.jsonl holds for ``step``."""
    if run_dir is None or step is None or not (run_dir / "metrics.jsonl").is_file():
        return False, None
    found, value = False, None
    for line in (run_dir / "metrics.jsonl").read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being appended right now
            continue
        if isinstance(row, dict) and row.get("step") == step and "eval/loss" in row:
            found, value = True, row["eval/loss"]
    if not found:
        return False, None
    return True, float(value) if isinstance(value, int | float) else math.nan


def check(model: Any, engine: Any, run_dir: Path | None, step: int | None,
          tolerance: float = TOLERANCE) -> GateReport:
    """Gate one version: ``model`` the torch GPT (None for a bare .onnx source: no reference to compare with),
    ``engine`` None for the torch engine, else the OrtEngine."""
    found, eval_loss = recorded_eval_loss(run_dir, step)
    if found and not (eval_loss is not None and math.isfinite(eval_loss)):
        return GateReport(False, f"the eval loss recorded for step {step} is {eval_loss}", None, eval_loss)
    vocab = int((model.config if model is not None else engine.config).vocab_size)
    prompts = gate_prompts(vocab)
    served = torch_engine_logits(model, prompts) if engine is None else ort_engine_logits(engine, prompts)
    if not bool(torch.isfinite(served).all().to("cpu")):
        return GateReport(False, "the engine's logits on the gate prompts are not finite (NaN/inf weights)", None,
                          eval_loss)
    if model is None:
        return GateReport(True, "finite logits (an .onnx source has no torch weights to compare with)", None, eval_loss)
    err = float((served - reference_logits(model, prompts)).abs().max().to("cpu"))
    if not err <= tolerance:
        return GateReport(False, f"engine vs torch max abs logit error {err:.3g} > {tolerance:g}", err, eval_loss)
    return GateReport(True, f"engine vs torch max abs logit error {err:.3g} <= {tolerance:g}", err, eval_loss)
