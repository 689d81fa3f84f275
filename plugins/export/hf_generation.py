"""What an exported Hugging Face folder needs besides its weights so that transformers generates as the run does:
the tokenizer's files (its chat template and special tokens among them) and ``generation_config.json``.

``generation_config.json`` starts from the original checkpoint's (the Hugging Face folder at the root of the run's
``model.init_from`` chain, which keeps e.g. its sampling defaults) and sets ``eos_token_id`` to the run's stop set
(:func:`crosstrain.generation.stops.stop_tokens`: the tokenizer's EOS, its template's end-of-turn tokens and the
original ``eos_token_id`` list), so ``model.generate`` ends a reply where ``crosstrain generate`` and serving do;
``bos_token_id`` and ``pad_token_id`` come from the tokenizer when it declares them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.atomic import atomic_path, atomic_write
from crosstrain.plugins.export.errors import ExportError


def copy_tokenizer_files(folder: Path, out: Path) -> list[str]:
    """Copy every file of :data:`~crosstrain.data.hf_tokenizer.TOKENIZER_FILES` that ``folder`` has into ``out``;
    a ``chat_template`` held only in ``tokenizer_config.json`` (transformers 4's way) is also written as
    ``chat_template.jinja``, as transformers 5 saves it. Returns the names written."""
    from crosstrain.data.hf_tokenizer import TOKENIZER_FILES

    names = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
    for name in names:
        with atomic_path(out / name) as tmp:
            shutil.copyfile(folder / name, tmp)
    if "chat_template.jinja" not in names and (folder / "tokenizer_config.json").is_file():
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
        if isinstance(template, str) and template:
            atomic_write(out / "chat_template.jinja", template)
            names.append("chat_template.jinja")
    return names


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise ExportError(f"{path} is not valid JSON ({exc}); fix or delete it, then export again") from None
    return doc if isinstance(doc, dict) else {}


def generation_config(tokenizer: dict[str, Any], origin: Path | None) -> dict[str, Any]:
    """The ``generation_config.json`` of an export whose run read ``tokenizer`` (export metadata: ``type`` and,
    for ``hf``, ``path``) and started from the Hugging Face folder ``origin`` (None: from scratch)."""
    from crosstrain.generation.stops import stop_tokens

    doc = _read(origin / "generation_config.json") if origin is not None else {}
    spec = str(tokenizer.get("path", "")) if tokenizer.get("type") == "hf" else ""
    stops = list(stop_tokens(spec, origin))
    if stops:
        doc["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    if spec:
        from crosstrain.data.hf_tokenizer import special_token_id

        for key in ("bos", "pad"):
            found = special_token_id(spec, f"{key}_token")
            if found is not None:
                doc[f"{key}_token_id"] = found
    return doc


def write_generation_files(tokenizer: dict[str, Any], origin: Path | None, cfg: Any, out: Path) -> list[str]:
    """The tokenizer's files (a generated ``tokenizer.json`` for the byte tokenizer) and ``generation_config.json``
    written into ``out``; returns their names."""
    if tokenizer.get("type") == "hf":
        names = copy_tokenizer_files(Path(tokenizer["path"]), out)
    elif tokenizer.get("type") == "byte":
        from crosstrain.data.byte_level import write_byte_tokenizer

        names = [p.name for p in write_byte_tokenizer(out, cfg.max_seq_len)]
    else:
        names = []
    written = _read(out / "generation_config.json")  # save_pretrained's (the generic path), if any
    doc = {**written, **generation_config(tokenizer, origin)}
    atomic_write(out / "generation_config.json", json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return sorted({*names, "generation_config.json"})
