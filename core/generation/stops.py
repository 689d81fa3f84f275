"""The one place that says which token ids end a generated row: ``crosstrain generate``, RL rollouts (GRPO/PPO)
and on-policy distillation call :func:`stop_tokens`; serving can call it the same way.

The set is the union of
- the tokenizer's EOS (``eos_token`` of ``tokenizer_config.json`` / ``special_tokens_map.json``),
- the end-of-turn tokens its chat template emits: a special added token named like one of :data:`END_OF_TURN`
  that the template (``chat_template`` of ``tokenizer_config.json``, or ``chat_template.jinja``) contains;
- ``eos_token_id`` (an int or a list) of ``generation_config.json`` in the model folder and in the tokenizer folder,
  which is how transformers' ``generate`` reads it (Llama-3-Instruct lists ``<|end_of_text|>``, ``<|eom_id|>``,
  ``<|eot_id|>`` there).
The byte tokenizer (``""`` / ``"byte"``) declares none of these: its stop set is empty.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from crosstrain.errors import ConfigError

#: names of end-of-turn tokens in the chat templates transformers ships (Llama 3, ChatML/Qwen, Gemma, Phi-3).
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); fix or delete it") from None
    return doc if isinstance(doc, dict) else {}


def generation_config_eos(folder: str | os.PathLike[str]) -> tuple[int, ...]:
    """``eos_token_id`` of ``folder/generation_config.json`` (an int or a list; none when absent)."""
    value = _json(Path(folder) / "generation_config.json").get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    return tuple(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool))


def chat_template(folder: str | os.PathLike[str]) -> str:
    """The chat template of a tokenizer folder (``chat_template.jinja``, else ``tokenizer_config.json``'s); ""
    without one."""
    folder = Path(folder)
    template = folder / "chat_template.jinja"
    if template.is_file():
        return template.read_text()
    value = _json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(value, list):  # transformers' named templates: [{"name", "template"}, ...]
        return "\n".join(str(t.get("template", "")) for t in value if isinstance(t, dict))
    return value if isinstance(value, str) else ""


def end_of_turn_tokens(folder: str | os.PathLike[str]) -> tuple[int, ...]:
    """Ids of the special tokens of ``folder/tokenizer.json`` named in :data:`END_OF_TURN` that its chat template
    emits (none without a template)."""
    folder = Path(folder)
    template = chat_template(folder)
    if not template:
        return ()
    added = _json(folder / "tokenizer.json").get("added_tokens", [])
    return tuple(int(t["id"]) for t in added if isinstance(t, dict) and t.get("special")
                 and t.get("content") in END_OF_TURN and t["content"] in template)


def stop_tokens(tokenizer: str | os.PathLike[str] = "", model_folder: str | os.PathLike[str] | None = None,
                extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The sorted stop set of a tokenizer spec (``data.tokenizer``: ``""``/``"byte"`` or a folder) and, when the
    model came from a Hugging Face folder, that folder; ``extra`` ids (a recipe's own stop string) join it."""
    from crosstrain.data.hf_tokenizer import describe_tokenizer

    ids = set(extra)
    spec = str(tokenizer)
    if spec not in ("", "byte"):
        eos = describe_tokenizer(spec)["eos_id"]
        if eos is not None:
            ids.add(int(eos))
        ids.update(end_of_turn_tokens(spec))
        ids.update(generation_config_eos(spec))
    if model_folder is not None and Path(model_folder).is_dir():
        ids.update(generation_config_eos(model_folder))
    return tuple(sorted(ids))
