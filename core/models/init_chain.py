"""Follow ``model.init_from`` back through crosstrain runs to where the model's shape was first stated.

A run started from another run (``model.init_from = runs/sft``) trains the same model: its shape is the source
run's, which may itself have come from a Hugging Face folder (``HF -> sft -> dpo -> grpo``). Each run dir keeps
its effective config in ``config.json`` (:func:`crosstrain.config.save_config`), so the chain is read from files:
each link's ``model.init_from`` and ``data.tokenizer``, until a Hugging Face folder or a run whose shape is its own
``model.*`` keys. A checkpoint with no run config around it (a bare ``step_N`` folder, a ``.safetensors`` file)
ends the chain with no origin: its shape is then the ``model.*`` keys of the run that reads it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crosstrain.errors import ConfigError


@dataclass(frozen=True)
class Origin:
    """Where a chain of ``model.init_from`` begins: a Hugging Face folder (``hf_folder``) or the ``model`` section
    of the first run (``model``: preset + overrides); ``tokenizer`` and ``max_seq_len`` are the nearest link's
    that set them; ``runs`` are the run dirs walked, nearest first."""

    hf_folder: Path | None
    model: dict[str, Any]
    tokenizer: str
    max_seq_len: int | None
    runs: tuple[Path, ...]

    def describe(self) -> str:
        """``runs/sft (from hf/llama)``: the nearest run and the root, for error messages."""
        if self.hf_folder is None:
            root = f"{self.runs[-1]}'s model.* keys"
            return root if len(self.runs) == 1 else f"{self.runs[0]} (from {root})"
        return f"{self.runs[0]} (from {self.hf_folder})" if self.runs else str(self.hf_folder)


def _run_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); restore the run's config.json") from None
    return data if isinstance(data, dict) and isinstance(data.get("model"), dict) else None


def _run_dir(p: Path) -> Path | None:
    """The run dir a checkpoint path belongs to (the path itself, its ``checkpoints/`` folder, or a ``step_N`` in
    it), found from names alone: nothing is verified, so config checks may call this often."""
    if (p / "checkpoints").is_dir() or (p / "config.toml").is_file():
        return p
    if p.name == "checkpoints":
        return p.parent
    return p.parent.parent if p.parent.name == "checkpoints" else None


def init_origin(path: str | os.PathLike[str], *, what: str = "model.init_from") -> Origin | None:
    """The :class:`Origin` of the weights ``path`` names (a Hugging Face folder, a run dir or a checkpoint inside
    one), or None for crosstrain weights without a run config. A chain that loops back is refused."""
    from crosstrain.checkpoint.resolve import source_kind

    runs: list[Path] = []
    tokenizer, max_seq_len = "", None
    current = str(path)
    while True:
        kind = source_kind(current, what=what)
        if kind == "hf":
            return Origin(Path(current), {}, tokenizer, max_seq_len, tuple(runs))
        run_dir = _run_dir(Path(current)) if kind == "checkpoint" else None
        config = _run_config(run_dir) if run_dir is not None else None
        if run_dir is None or config is None:
            return Origin(None, {}, tokenizer, max_seq_len, tuple(runs)) if runs else None
        run_dir = run_dir.resolve()
        if run_dir in runs:
            raise ConfigError(f"{what} {str(path)!r} leads back to {run_dir} through model.init_from; "
                              "point model.init_from at a run that does not start from itself")
        runs.append(run_dir)
        model, data = config["model"], config.get("data") or {}
        tokenizer = tokenizer or str(data.get("tokenizer") or "")
        max_seq_len = max_seq_len or model.get("max_seq_len")
        if not model.get("init_from"):
            return Origin(None, model, tokenizer, max_seq_len, tuple(runs))
        what = f"{run_dir}/config.json model.init_from"
        current = str(model["init_from"])
        beside = run_dir.parent / current  # a relative path, read from where the runs sit when not from here
        if not Path(current).exists() and beside.exists():
            current = str(beside)


def inherit_tokenizer(config: Any) -> None:
    """Set ``data.tokenizer`` to the chain's when the run names none: a run from another run reads its data as that
    one did. A run on embedded data (no ``data.path``: bytes, or a recipe's own rows) keeps the byte tokenizer."""
    if config.data.tokenizer or not config.data.path or not config.model.init_from or config.model.import_path:
        return
    origin = init_origin(config.model.init_from)
    if origin is not None and origin.tokenizer:
        config.data.tokenizer = origin.tokenizer
