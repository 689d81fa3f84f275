"""JSONL rows for SFT and preference training, the chat template, tokenisation, truncation and padded batches.

Rows (one JSON object per line):

- SFT: ``{"prompt": str, "completion": str}`` or ``{"messages": [{"role", "content"}, ...]}`` (the last message is
  the assistant's completion, everything before it the prompt).
- Preference: ``{"prompt", "chosen", "rejected"}``, each a string, or in messages form (``prompt`` a message list,
  ``chosen``/``rejected`` assistant message lists; without ``prompt`` the shared prefix of ``chosen`` and
  ``rejected`` is the prompt, as in TRL's implicit-prompt datasets).

The chat template renders each message as ``<|{role}|>\\n{content}\\n`` and a prompt ends with the generation
prompt ``<|assistant|>\\n``; a completion is ``{content}\\n``. String prompts and completions are used verbatim.

Truncation: the prompt keeps its *last* ``max_prompt_length`` tokens (and at most ``max_length - 1``), then the
completion keeps its first ``max_length - len(prompt)`` tokens; each truncated row is counted. Batches are right
padded (pad id 0) with an ``attention_mask``; under causal attention no real token attends to a pad, so the GPT
needs no key mask, and ``loss_mask`` is 1 only on completion tokens.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crosstrain.errors import ConfigError, CrosstrainWarning

ROLES = ("system", "user", "assistant")
GENERATION_PROMPT = "<|assistant|>\n"


class RowError(ValueError):
    """A malformed row (the message names what is wrong; the reader adds file and line)."""


def render_messages(messages: Any) -> str:
    """The chat template over a list of ``{"role", "content"}`` messages."""
    if not isinstance(messages, list) or not messages:
        raise RowError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise RowError(f"each message needs a role in {', '.join(ROLES)} and a string content, got {m!r:.80}")
        out.append(f"<|{m['role']}|>\n{m['content']}\n")
    return "".join(out)


def _completion(value: Any, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) \
            and value[0].get("role") == "assistant" and isinstance(value[0].get("content"), str):
        return value[0]["content"] + "\n"
    raise RowError(f"{key!r} must be a string or one assistant message")


def _prompt(value: Any) -> str:
    if isinstance(value, str):
        return value
    return render_messages(value) + GENERATION_PROMPT


def parse_sft_row(row: Any) -> tuple[str, str]:
    """``(prompt, completion)`` text of an SFT row."""
    if not isinstance(row, dict):
        raise RowError("a row must be a JSON object")
    if "messages" in row:
        msgs = row["messages"]
        render_messages(msgs)
        if msgs[-1]["role"] != "assistant":
            raise RowError("the last message must be the assistant's (it is the completion)")
        prompt = render_messages(msgs[:-1]) + GENERATION_PROMPT if len(msgs) > 1 else GENERATION_PROMPT
        return prompt, msgs[-1]["content"] + "\n"
    missing = [k for k in ("prompt", "completion") if not isinstance(row.get(k), str)]
    if missing:
        raise RowError(f"needs string {' and '.join(repr(k) for k in missing)} (or a \"messages\" list)")
    if not row["completion"]:
        raise RowError("'completion' is empty")
    return row["prompt"], row["completion"]


def parse_preference_row(row: Any) -> tuple[str, str, str]:
    """``(prompt, chosen, rejected)`` text of a preference row."""
    if not isinstance(row, dict):
        raise RowError("a row must be a JSON object")
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise RowError(f"needs {' and '.join(repr(k) for k in missing)}")
    chosen, rejected = row["chosen"], row["rejected"]
    if "prompt" not in row:  # implicit prompt: the shared prefix of two message lists
        if not (isinstance(chosen, list) and isinstance(rejected, list) and len(chosen) >= 2
                and chosen[:-1] == rejected[:-1] and len(chosen) == len(rejected)):
            raise RowError("needs 'prompt', or 'chosen'/'rejected' message lists that differ only in the last message")
        prompt: Any = chosen[:-1]
        chosen, rejected = chosen[-1:], rejected[-1:]
    else:
        prompt = row["prompt"]
    out = (_prompt(prompt), _completion(chosen, "chosen"), _completion(rejected, "rejected"))
    if not out[1] or not out[2]:
        raise RowError("'chosen' and 'rejected' must not be empty")
    return out


def read_jsonl(path: str, parse: Any, *, skip_bad_rows: bool) -> tuple[list[Any], int]:
    """Parsed rows of a JSONL file and how many were skipped; a bad row is a one-line ConfigError naming
    ``file:line`` unless ``skip_bad_rows``. Blank lines are ignored."""
    rows: list[Any] = []
    skipped = 0
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path} does not exist; point data.path at a JSONL file (or leave it empty for the "
                          "embedded task)")
    from crosstrain.data.tokenfile import MAGIC

    with p.open("rb") as f:
        if f.read(len(MAGIC)) == MAGIC:
            raise ConfigError(f"{path} is a crosstrain token file (for --recipe lm); data.path of this recipe is a "
                              "JSONL file of rows (docs/rlhf.md), or empty for the embedded task")
        f.seek(0)
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise RowError(f"not UTF-8 text ({exc.reason} at byte {exc.start}); save the file as "
                                   "UTF-8") from None
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    raise RowError(f"not valid JSON ({exc})") from None
                rows.append(parse(obj))
            except RowError as exc:
                if not skip_bad_rows:
                    raise ConfigError(f"{path}:{number}: {exc}; fix the row or set data.skip_bad_rows=true") from None
                skipped += 1
    if not rows:
        raise ConfigError(f"{path} has no usable rows ({skipped} skipped)")
    return rows, skipped


@dataclass
class Encoded:
    """One tokenised prompt + completion: ``ids`` and the number of prompt tokens among them."""

    ids: np.ndarray
    prompt_len: int
    truncated: bool


def encode(tokenizer: Any, prompt: str, completion: str, max_length: int, max_prompt_length: int) -> Encoded:
    """Tokenise and truncate (rules in the module docstring)."""
    p = np.asarray(tokenizer.encode(prompt), dtype=np.int64)
    c = np.asarray(tokenizer.encode(completion), dtype=np.int64)
    keep_prompt = min(len(p), max_prompt_length, max_length - 1)
    truncated = keep_prompt < len(p)
    p = p[len(p) - keep_prompt:]
    keep_completion = min(len(c), max_length - len(p))
    truncated = truncated or keep_completion < len(c)
    return Encoded(np.concatenate([p, c[:keep_completion]]), len(p), truncated)


def pad(seqs: list[Encoded]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` (completion tokens) ``[N, max_len]``."""
    width = max(len(s.ids) for s in seqs)
    ids = np.zeros((len(seqs), width), dtype=np.int64)
    attn = np.zeros((len(seqs), width), dtype=bool)
    loss = np.zeros((len(seqs), width), dtype=bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s.ids)] = s.ids
        attn[i, : len(s.ids)] = True
        loss[i, s.prompt_len : len(s.ids)] = True
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(attn),
            "loss_mask": torch.from_numpy(loss)}


def pad_prompts(prompts: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Right-padded prompts for generation and their lengths."""
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return {"prompt_ids": torch.from_numpy(ids), "prompt_lengths": torch.tensor([len(p) for p in prompts])}


class SFTDataset:
    """Prompt + completion sequences; ``batch`` pads them (module docstring)."""

    def __init__(self, rows: list[Encoded]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices: Any) -> dict[str, torch.Tensor]:
        seqs = [self.rows[int(i)] for i in indices]
        out = pad(seqs)
        out["truncated"] = torch.tensor([float(s.truncated) for s in seqs])
        return out


class PreferenceDataset:
    """Pairs; ``batch`` returns the chosen sequences then the rejected ones in one padded ``[2B, T]`` batch (one
    forward for both, as TRL's concatenated forward), plus the prompts for generation."""

    def __init__(self, pairs: list[tuple[Encoded, Encoded]], prompts: list[np.ndarray]) -> None:
        self.pairs = pairs
        self.prompts = prompts
        self.reference_logps: torch.Tensor | None = None  # [N, 2] (chosen, rejected), rlhf.reference="precomputed"
        #: called once before the first batch that needs ``reference_logps`` (fills it; see rlhf.reference_cache)
        self.fill_reference: Callable[[], None] | None = None
        #: the padded prompts (greedy generation in eval); training batches leave them out (no copies per step)
        self.with_prompts = True

    def __len__(self) -> int:
        return len(self.pairs)

    def sequences(self, idx: list[int]) -> dict[str, torch.Tensor]:
        """The padded ``[2B, T]`` chosen-then-rejected batch of pairs ``idx`` (no prompts, no reference)."""
        return pad([self.pairs[i][0] for i in idx] + [self.pairs[i][1] for i in idx])

    def batch(self, indices: Any) -> dict[str, torch.Tensor]:
        idx = [int(i) for i in indices]
        out = self.sequences(idx)
        out["truncated"] = torch.tensor([float(self.pairs[i][0].truncated or self.pairs[i][1].truncated)
                                         for i in idx])
        if self.with_prompts:
            out.update(pad_prompts([self.prompts[i] for i in idx]))
        if self.reference_logps is None and self.fill_reference is not None:
            self.fill_reference()
        if self.reference_logps is not None:
            ref = self.reference_logps[idx]
            out["reference_logps"] = torch.cat([ref[:, 0], ref[:, 1]])
        return out


def encode_sft(tokenizer: Any, rows: list[tuple[str, str]], max_length: int, max_prompt_length: int) -> SFTDataset:
    return SFTDataset([encode(tokenizer, p, c, max_length, max_prompt_length) for p, c in rows])


def check_ties(dataset: PreferenceDataset, source: str) -> None:
    """Pairs whose chosen and rejected tokens are equal (as truncated) carry no preference: the DPO and
    Bradley-Terry gradients vanish on them. All such pairs is an error, some a warning."""
    ties = sum(bool(np.array_equal(c.ids, r.ids)) for c, r in dataset.pairs)
    if ties and ties == len(dataset.pairs):
        raise ConfigError(f"every training pair of {source} has chosen == rejected (after truncation), so there is "
                          "nothing to learn; fix the data (or raise rlhf.max_length if they differ later)")
    if ties:
        warnings.warn(f"{ties} of {len(dataset.pairs)} training pairs of {source} have chosen == rejected (after "
                      "truncation) and teach nothing", CrosstrainWarning, stacklevel=2)


def encode_preferences(tokenizer: Any, rows: list[tuple[str, str, str]], max_length: int,
                       max_prompt_length: int) -> PreferenceDataset:
    pairs = [(encode(tokenizer, p, c, max_length, max_prompt_length),
              encode(tokenizer, p, r, max_length, max_prompt_length)) for p, c, r in rows]
    prompts = [pair[0].ids[: pair[0].prompt_len] for pair in pairs]
    return PreferenceDataset(pairs, prompts)
