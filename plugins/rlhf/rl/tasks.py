"""Prompts and rewards of the ``grpo`` and ``ppo`` recipes: the embedded task, JSONL prompts and ``reward.fn``.

The embedded task needs no files: prompts are the chat-template prompts of the embedded corpus windows
(:mod:`crosstrain.plugins.rlhf.synthetic`, held-out prompts from held-out chapters) and the reward of a
completion is the fraction of its characters that are vowels (:func:`vowel_fraction`, maximum 1.0). A tiny
byte-level GPT starts near 5/256 (uniform bytes) and learns it within minutes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from crosstrain.data.chat_template import ChatTemplate
from crosstrain.errors import ConfigError
from crosstrain.plugins.rlhf import synthetic
from crosstrain.plugins.rlhf.data import (
    GENERATION_PROMPT,
    Rendered,
    RowError,
    conversation,
    read_jsonl,
    render_messages,
    row_tools,
    templated,
)

VOWELS = frozenset("aeiouAEIOU")
TASK_MAX = 1.0

RewardFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]


def vowel_fraction(completions: Sequence[str], prompts: Sequence[str]) -> list[float]:
    """The embedded task's reward: the share of each completion's characters that are vowels (0 if empty)."""
    return [sum(ch in VOWELS for ch in c) / len(c) if c else 0.0 for c in completions]


def embedded_prompts(val_fraction: float) -> tuple[list[str], list[str]]:
    """Train and held-out chat prompts of the embedded task (the same windows as the sft/dpo tasks)."""
    train, val = synthetic._split_windows(val_fraction, synthetic.SEED + 4)
    return [synthetic.chat_prompt(p) for p, _ in train], [synthetic.chat_prompt(p) for p, _ in val]


def parse_prompt_row(row: Any, chat: ChatTemplate | None = None) -> str | Rendered:
    """A JSONL prompt row: ``{"prompt": "..."}`` or ``{"messages": [...], "tools": [...]}`` (rendered by ``chat``,
    the tokenizer's template, or crosstrain's format; generation prompt added); other keys (a reference answer for
    ``reward.fn``, say) are ignored."""
    if not isinstance(row, dict):
        raise RowError("a row must be a JSON object")
    if isinstance(row.get("prompt"), str) and row["prompt"]:
        return row["prompt"]
    if "messages" in row and chat is not None:
        text = templated(chat.render, conversation(row["messages"]), row_tools(row), True)
        return Rendered(text, templated=True)
    if "messages" in row:
        return render_messages(row["messages"]) + GENERATION_PROMPT
    raise RowError('needs a non-empty string "prompt" (or a "messages" list)')


def read_prompts(path: str, skip_bad_rows: bool, chat: ChatTemplate | None = None) -> tuple[list[str | Rendered], int]:
    return read_jsonl(path, functools.partial(parse_prompt_row, chat=chat), skip_bad_rows=skip_bad_rows)


def load_reward_fn(spec: str) -> RewardFn:
    """``reward.fn = "pkg.mod:fn"`` resolved to the callable; failures are one-line ConfigErrors."""
    from crosstrain.config import resolve_import_path

    return resolve_import_path(spec, key="reward.fn")  # type: ignore[no-any-return]


def call_reward_fn(fn: RewardFn, spec: str, completions: list[str], prompts: list[str],
                   where: str = "") -> list[float]:
    """``fn(completions, prompts)`` checked: one finite float per completion. An exception it raises is one line
    naming the function and ``where`` it was scoring (the step); its traceback is logged (``crosstrain -v``)."""
    try:
        out = list(fn(completions, prompts))
    except Exception as exc:
        logging.getLogger(__name__).info("reward.fn %s raised:", spec, exc_info=True)
        at = f" at {where}" if where else ""
        first = (str(exc).splitlines() or [""])[0]  # one line, whatever the user's message holds
        raise ConfigError(f"reward.fn {spec} raised {type(exc).__name__}: {first}{at}; fix the function (run "
                          "'crosstrain -v train ...' to see its traceback)") from None
    if len(out) != len(completions):
        raise ConfigError(f"reward.fn {spec} returned {len(out)} rewards for {len(completions)} completions; "
                          "return one float per completion")
    try:
        values = [float(v) for v in out]
    except (TypeError, ValueError):
        raise ConfigError(f"reward.fn {spec} returned a non-number; return a list of floats") from None
    if any(v != v or v in (float("inf"), float("-inf")) for v in values):
        raise ConfigError(f"reward.fn {spec} returned a non-finite reward; return finite floats")
    return values
