"""How ``/v1/chat/completions`` turns messages into a prompt, and which tokens end a reply.

The messages are rendered as the run's training data was (``data.chat_template``, core/data/chat_template.py): with
the tokenizer's own chat template under ``auto`` when it has one, or the template file the run named, through
transformers' ``apply_chat_template(messages, add_generation_prompt=True)``; the reply then ends at the tokenizer's
stop set (:func:`crosstrain.generation.stops.stop_tokens`: EOS, the template's end-of-turn tokens,
``generation_config.json``'s ``eos_token_id``). Other runs (the byte tokenizer, no template, ``none``) keep
crosstrain's ``<|role|>`` format (plugins/rlhf/data.py), whose reply ends where the next ``<|role|>`` tag begins.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from crosstrain.data.chat_template import ChatTemplate, resolve

#: crosstrain's format: a message is ``<|role|>\n{content}\n``, so the reply is the content before the next tag
CHAT_STOPS = ("\n<|", "<|")


@lru_cache(maxsize=8)
def _template(setting: str, path: str, sha256: str) -> ChatTemplate | None:
    return resolve(setting, path)


def template_of(tokenizer: dict[str, Any]) -> ChatTemplate | None:
    """The chat template a served tokenizer (export metadata: ``type``, ``path``, ``chat_template``) renders with,
    or None for crosstrain's format."""
    if tokenizer.get("type") != "hf":
        return None
    return _template(str(tokenizer.get("chat_template") or "auto"), str(tokenizer["path"]),
                     str(tokenizer.get("sha256")))


@lru_cache(maxsize=8)
def _stops(path: str, sha256: str) -> tuple[int, ...]:
    from crosstrain.generation.stops import stop_tokens

    return stop_tokens(path)


def stop_ids(tokenizer: dict[str, Any]) -> tuple[int, ...]:
    """The token ids that end a served reply: the tokenizer's stop set, or its EOS alone (none for bytes)."""
    if tokenizer.get("type") == "hf":
        return _stops(str(tokenizer["path"]), str(tokenizer.get("sha256")))
    eos = tokenizer.get("eos_id")
    return () if eos is None else (int(eos),)


def render_chat(tokenizer: dict[str, Any], messages: list[dict[str, str]]) -> tuple[str, tuple[str, ...]]:
    """The prompt text of ``messages`` with the generation prompt, and the stop strings that end the reply (none
    with a chat template: its stop tokens do). Raises ``ValueError`` for messages the format cannot render."""
    template = template_of(tokenizer)
    if template is not None:
        return template.render(messages, add_generation_prompt=True), ()
    from crosstrain.plugins.rlhf.data import GENERATION_PROMPT, render_messages

    return render_messages(messages) + GENERATION_PROMPT, CHAT_STOPS  # its RowError is a ValueError
