"""``data.chat_template``: conversations rendered by a tokenizer's own chat template, through transformers'
``apply_chat_template`` (issue 38).

``"auto"`` uses the template of the ``data.tokenizer`` folder when it has one (``chat_template.jinja`` or
``tokenizer_config.json``'s ``chat_template``), else crosstrain's ``<|role|>`` format; ``"none"`` always uses
crosstrain's format; a PATH is a Jinja template file used with the ``data.tokenizer`` folder. :func:`resolve` returns
``None`` for crosstrain's format (the rows' code renders it).

What the assistant writes is found the way TRL's ``assistant_only_loss`` defines it, without needing
``{% generation %}`` markers in the template: the characters between the conversation up to an assistant message
rendered with the generation prompt and the conversation up to and including it (its content and the template's
end-of-turn token, ``<|eot_id|>`` for Llama 3). The template must render conversations prefix by prefix (every
template transformers ships for Llama, Qwen, Mistral and Gemma does); one that does not is refused.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from crosstrain.errors import ConfigError

Span = tuple[int, int]


@lru_cache(maxsize=8)
def _transformers_tokenizer(folder: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            "a chat template needs the 'transformers' package; pip install 'crosstrain[hf]', or set "
            "data.chat_template=none"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        first = (str(exc).splitlines() or [""])[0]
        raise ConfigError(
            f"transformers cannot load the tokenizer folder {folder} to render its chat template ({first}); fix "
            "the folder or set data.chat_template=none"
        ) from None


class ChatTemplate:
    """A tokenizer folder's chat template (``template=None``) or a template text, rendered by transformers (loaded
    at the first render, so string rows never import it)."""

    def __init__(self, folder: str, template: str | None, source: str) -> None:
        self.folder = folder
        self.template = template
        #: what summary.json says was used: "tokenizer" or the template file's path
        self.source = source

    def render(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None, add_generation_prompt: bool = False
    ) -> str:
        """``tokenizer.apply_chat_template(messages, tokenize=False)``; a template error is a ValueError."""
        tokenizer = _transformers_tokenizer(self.folder)
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja2's TemplateError, or the template's own raise_exception
            first = (str(exc).splitlines() or [""])[0]
            raise ValueError(f"the chat template cannot render it ({type(exc).__name__}: {first})") from None
        return str(text)

    def _prefix(self, head: str, full: str, what: str) -> None:
        if not full.startswith(head):
            raise ConfigError(
                f"the chat template ({self.source}) renders {what} differently from the conversation "
                "it begins, so the trained tokens cannot be found; use a template that renders "
                "conversations prefix by prefix (data.chat_template=PATH) or data.chat_template=none"
            )

    def assistant_spans(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None
    ) -> tuple[str, tuple[Span, ...]]:
        """The rendered conversation and the character span of each assistant message (module docstring)."""
        text = self.render(messages, tools)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            head = self.render(messages[:i], tools, add_generation_prompt=True)
            upto = self.render(messages[: i + 1], tools)
            self._prefix(head, upto, "a prompt with its generation prompt")
            self._prefix(upto, text, "the start of a conversation")
            spans.append((len(head), len(upto)))
        return text, tuple(spans)

    def completion_span(
        self, prompt: list[dict[str, Any]], completion: list[dict[str, Any]], tools: list[Any] | None = None
    ) -> tuple[str, Span]:
        """``prompt + completion`` rendered and the span of the completion (after the generation prompt), as TRL
        splits a conversational prompt-completion row."""
        head = self.render(prompt, tools, add_generation_prompt=True)
        text = self.render(prompt + completion, tools)
        self._prefix(head, text, "a prompt with its generation prompt")
        return text, (len(head), len(text))


def resolve(setting: str, tokenizer: str) -> ChatTemplate | None:
    """The template ``data.chat_template`` names for the ``data.tokenizer`` spec, or None for crosstrain's format."""
    from crosstrain.generation.stops import chat_template_text

    byte = tokenizer in ("", "byte")
    if setting == "none" or (setting == "auto" and (byte or not chat_template_text(tokenizer))):
        return None
    if setting == "auto":
        return ChatTemplate(str(Path(tokenizer).resolve()), None, "tokenizer")
    path = Path(os.path.expanduser(setting))
    if not path.is_file():
        raise ConfigError(
            f"data.chat_template={setting!r} is not a file; use auto, none or the path of a Jinja chat template"
        )
    if byte:
        raise ConfigError(
            f"data.chat_template={setting!r} needs a Hugging Face tokenizer folder in data.tokenizer "
            "(the byte tokenizer has no special tokens to render it with); set data.tokenizer or "
            "data.chat_template=none"
        )
    return ChatTemplate(str(Path(tokenizer).resolve()), path.read_text(), str(path.resolve()))


def describe(template: ChatTemplate | None) -> str:
    """What summary.json records: "tokenizer", the template file's path, or "crosstrain" (its own format)."""
    return "crosstrain" if template is None else template.source
