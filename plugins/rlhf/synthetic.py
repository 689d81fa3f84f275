"""The embedded synthetic tasks: every recipe runs with no files, and a tiny model's behaviour visibly changes.

Prompts are 24-character windows of the embedded corpus (crosstrain.data.corpus) in the chat template, asking
for the next 16 characters. SFT completions are that continuation as written; preference pairs prefer the
continuation in UPPER CASE (``chosen``) to the same text in lower case (``rejected``), so ``win_rate`` (the share
of greedy completions that are upper case) shows whether preference training worked. Held-out prompts come only
from the last ``ceil(data.val_fraction x chapters)`` chapters (at least one), training prompts from the others,
and a held-out prompt never equals a training prompt.
"""

from __future__ import annotations

import math

import numpy as np

from crosstrain.plugins.rlhf.data import GENERATION_PROMPT, render_messages

PROMPT_CHARS = 24
COMPLETION_CHARS = 16
TRAIN_PROMPTS = 2048
EVAL_PROMPTS = 128
SEED = 1234  # the task is fixed data: it does not follow train.seed


def _windows(chapters: list[str], n: int, seed: int) -> list[tuple[str, str]]:
    bodies = [" ".join(" ".join(c.split("\n")[1:]).split()) for c in chapters]  # no title line, one space
    text = " ".join(bodies)
    starts = [i for i in range(1, len(text) - PROMPT_CHARS - COMPLETION_CHARS) if text[i - 1] == " "]
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(starts), size=min(n, len(starts)), replace=False)
    out = []
    for k in sorted(int(p) for p in picks):
        s = starts[k]
        out.append((text[s : s + PROMPT_CHARS], text[s + PROMPT_CHARS : s + PROMPT_CHARS + COMPLETION_CHARS]))
    return out


def _split_windows(val_fraction: float, seed: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Train windows from the training chapters; held-out windows from the held-out chapters whose prompt text
    never occurs as a training prompt (the corpus repeats phrases across chapters)."""
    train_chapters, val_chapters = split_chapters(val_fraction)
    train = _windows(train_chapters, TRAIN_PROMPTS, seed)
    seen = {p for p, _ in train}
    val = [w for w in _windows(val_chapters, 8 * EVAL_PROMPTS, seed + 1) if w[0] not in seen][:EVAL_PROMPTS]
    return train, val


def chat_prompt(snippet: str) -> str:
    return render_messages([{"role": "user", "content": snippet}]) + GENERATION_PROMPT


def split_chapters(val_fraction: float) -> tuple[list[str], list[str]]:
    from crosstrain.data.sources import corpus_documents

    docs = corpus_documents()
    n_val = min(len(docs) - 1, max(1, math.ceil(val_fraction * len(docs))))
    return docs[:-n_val], docs[-n_val:]


def sft_rows(val_fraction: float) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Train and held-out ``(prompt, completion)`` rows: the corpus continuation as written."""
    train, val = _split_windows(val_fraction, SEED)
    return [(chat_prompt(p), c + "\n") for p, c in train], [(chat_prompt(p), c + "\n") for p, c in val]


def preference_rows(val_fraction: float) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """Train and held-out ``(prompt, chosen, rejected)``: chosen upper case, rejected lower case."""
    train, val = _split_windows(val_fraction, SEED + 2)

    def rows(windows: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
        return [(chat_prompt(p), c.upper() + "\n", c.lower() + "\n") for p, c in windows]

    return rows(train), rows(val)


def shows_trait(text: str) -> bool:
    """The preferred trait: the completion (up to its first newline) has letters and >= 80% are upper case."""
    letters = [ch for ch in text.split("\n", 1)[0] if ch.isalpha()]
    return bool(letters) and sum(ch.isupper() for ch in letters) >= 0.8 * len(letters)
