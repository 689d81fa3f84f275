"""JSONL rows for SFT and preference training, chat templates, tokenisation, truncation and padded batches.

Rows (one JSON object per line):

- SFT: ``{"prompt": str, "completion": str}`` or ``{"messages": [{"role", "content"}, ...], "tools": [...]}``.
- Preference: ``{"prompt", "chosen", "rejected"}``, each a string, or in messages form (``prompt`` a message list,
  ``chosen``/``rejected`` assistant message lists; without ``prompt`` the shared prefix of ``chosen`` and
  ``rejected`` is the prompt, as in TRL's implicit-prompt datasets).

``data.chat_template`` (:mod:`crosstrain.data.chat_template`) picks how messages become text. With the tokenizer's
own template (``auto`` with a template in the tokenizer folder, or a PATH) a conversation is rendered by
transformers' ``apply_chat_template`` and tokenised without added special tokens, exactly as
``apply_chat_template(messages, tokenize=True)`` does: the template writes BOS and each turn's end-of-turn token.
SFT trains on every assistant message and its end-of-turn token (TRL's ``assistant_only_loss``); preference rows
train on the completion after the generation prompt. Otherwise (``none``, or ``auto`` without a template)
crosstrain's format renders each message as ``<|{role}|>\\n{content}\\n``, a prompt ends with the generation
prompt ``<|assistant|>\\n`` and a completion is ``{content}\\n`` (SFT trains on the last message only).

String prompts and completions (and crosstrain's format) are used verbatim, tokenised as one text with the
tokenizer's special tokens (BOS as its ``tokenizer.json`` post-processor adds it) and the tokenizer's EOS appended to
each completion that does not end with it, as TRL does, so the model learns to stop (the byte tokenizer has
neither).

Truncation: the prompt (the tokens before the first trained one) keeps its *last* ``max_prompt_length`` tokens (and
at most ``max_length - 1``), then the rest keeps its first ``max_length - len(prompt)`` tokens; each truncated row
is counted. Batches are right padded (pad id 0) with an ``attention_mask``; under causal attention no real token
attends to a pad, so the GPT needs no key mask, and ``loss_mask`` is 1 only on trained tokens.
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

from crosstrain.data.chat_template import ChatTemplate
from crosstrain.errors import ConfigError, CrosstrainWarning

ROLES = ("system", "user", "assistant")
GENERATION_PROMPT = "<|assistant|>\n"


class RowError(ValueError):
    """A malformed row (the message names what is wrong; the reader adds file and line)."""


@dataclass(frozen=True)
class Rendered:
    """A row as one text and the character ``spans`` the loss trains on. ``templated``: a chat template wrote it,
    special tokens included, so the tokenizer adds none (as ``apply_chat_template`` tokenises)."""

    text: str
    spans: tuple[tuple[int, int], ...] = ()
    templated: bool = False


def conversation(messages: Any) -> list[dict[str, Any]]:
    """``messages`` checked for a chat template: any role (tool turns too), a string content or tool calls."""
    if not isinstance(messages, list) or not messages:
        raise RowError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not (isinstance(m.get("content"), str) or "tool_calls" in m):
            raise RowError(f"each message needs a string role and a string content (or tool_calls), got {m!r:.80}")
    return messages


def row_tools(row: dict[str, Any]) -> list[Any] | None:
    """A row's ``tools`` (function schemas the template renders), checked; None when absent."""
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RowError("'tools' must be a list of JSON-schema function objects")
    return tools


def templated(render: Callable[..., Any], *args: Any) -> Any:
    """``render(*args)`` with a template's error as a RowError (named on the row's file and line)."""
    try:
        return render(*args)
    except ValueError as exc:  # the template's own error, named on the row
        raise RowError(str(exc)) from None


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


def parse_sft_row(row: Any, chat: ChatTemplate | None = None) -> tuple[str, str] | Rendered:
    """``(prompt, completion)`` text of an SFT row; a ``messages`` row rendered by ``chat`` (a tokenizer's template)
    is one text with the span of every assistant message."""
    if not isinstance(row, dict):
        raise RowError("a row must be a JSON object")
    if "messages" in row and chat is not None:
        msgs = conversation(row["messages"])
        if not any(m["role"] == "assistant" for m in msgs):
            raise RowError("no assistant message: there is nothing to train on")
        text, spans = templated(chat.assistant_spans, msgs, row_tools(row))
        return Rendered(text, spans, templated=True)
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


def _assistant(value: Any, key: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        raise RowError(f"{key!r} must be a string or a list of messages")
    return conversation(value)


def parse_preference_row(row: Any, chat: ChatTemplate | None = None) -> tuple[str, str, str] | tuple[Rendered,
                                                                                                       Rendered]:
    """``(prompt, chosen, rejected)`` text of a preference row; a conversational row rendered by ``chat`` (a
    tokenizer's template) is ``(chosen, rejected)``, each the whole conversation with the completion's span."""
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
    if chat is not None and isinstance(prompt, list):
        msgs, tools = conversation(prompt), row_tools(row)
        pair = []
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            text, span = templated(chat.completion_span, msgs, _assistant(value, key), tools)
            if span[0] == span[1]:
                raise RowError(f"{key!r} must not be empty")
            pair.append(Rendered(text, (span,), templated=True))
        return pair[0], pair[1]
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
    """One tokenised row: ``ids``, the number of prompt tokens (before the first trained one) and the trained
    tokens' ``mask`` (all tokens after the prompt unless a chat template left gaps between assistant turns)."""

    ids: np.ndarray
    prompt_len: int
    truncated: bool
    mask: np.ndarray | None = None

    def loss_mask(self) -> np.ndarray:
        if self.mask is not None:
            return self.mask
        return np.arange(len(self.ids)) >= self.prompt_len


def plain(tokenizer: Any, prompt: str, completion: str) -> Rendered:
    """A string prompt and completion as one text, the tokenizer's EOS closing the completion (module docstring)."""
    eos = getattr(tokenizer, "eos_token", None)
    if eos and not completion.endswith(eos):
        completion += eos
    return Rendered(prompt + completion, ((len(prompt), len(prompt) + len(completion)),))


def tokenize(tokenizer: Any, row: Rendered) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, trained-token mask)`` of a rendered row: a token is trained when its characters overlap a span
    (tokens the tokenizer adds have no characters and are never trained)."""
    ids, offsets = tokenizer.encode_offsets(row.text, add_special_tokens=not row.templated)
    mask = np.zeros(len(ids), dtype=bool)
    for a, b in row.spans:
        mask |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    return np.asarray(ids, dtype=np.int64), mask


def encode_rendered(tokenizer: Any, row: Rendered, max_length: int, max_prompt_length: int) -> Encoded:
    """Tokenise and truncate a rendered row (rules in the module docstring)."""
    ids, mask = tokenize(tokenizer, row)
    first = int(mask.argmax()) if mask.any() else len(ids)
    keep_prompt = min(first, max_prompt_length, max_length - 1)
    keep_rest = min(len(ids) - first, max_length - keep_prompt)
    start, stop = first - keep_prompt, first + keep_rest
    return Encoded(ids[start:stop], keep_prompt, start > 0 or stop < len(ids), mask[start:stop])


def encode(tokenizer: Any, prompt: str, completion: str, max_length: int, max_prompt_length: int) -> Encoded:
    """Tokenise and truncate a string prompt and completion (rules in the module docstring)."""
    return encode_rendered(tokenizer, plain(tokenizer, prompt, completion), max_length, max_prompt_length)


def encode_row(tokenizer: Any, row: tuple[str, str] | Rendered, max_length: int, max_prompt_length: int) -> Encoded:
    if isinstance(row, Rendered):
        return encode_rendered(tokenizer, row, max_length, max_prompt_length)
    return encode(tokenizer, row[0], row[1], max_length, max_prompt_length)


def encode_prompt(tokenizer: Any, prompt: str | Rendered) -> np.ndarray:
    """Ids of a generation prompt: a template-rendered one as written, a string one with the tokenizer's special
    tokens (BOS as its post-processor adds it)."""
    row = prompt if isinstance(prompt, Rendered) else Rendered(prompt)
    return tokenize(tokenizer, row)[0]


def show(tokenizer: Any, row: Encoded) -> dict[str, Any]:
    """A row as training sees it: its decoded text, ids, loss mask and the decoded trained tokens."""
    mask = row.loss_mask()
    return {"text": tokenizer.decode(row.ids), "input_ids": [int(i) for i in row.ids],
            "loss_mask": [int(m) for m in mask], "trained_text": tokenizer.decode(row.ids[mask]),
            "truncated": bool(row.truncated)}


def pad(seqs: list[Encoded]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` (completion tokens) ``[N, max_len]``."""
    width = max(len(s.ids) for s in seqs)
    ids = np.zeros((len(seqs), width), dtype=np.int64)
    attn = np.zeros((len(seqs), width), dtype=bool)
    loss = np.zeros((len(seqs), width), dtype=bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s.ids)] = s.ids
        attn[i, : len(s.ids)] = True
        loss[i, : len(s.ids)] = s.loss_mask()
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


def encode_sft(tokenizer: Any, rows: list[tuple[str, str] | Rendered], max_length: int,
               max_prompt_length: int) -> SFTDataset:
    return SFTDataset([encode_row(tokenizer, row, max_length, max_prompt_length) for row in rows])


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


def encode_preferences(tokenizer: Any, rows: list[tuple[str, str, str] | tuple[Rendered, Rendered]], max_length: int,
                       max_prompt_length: int) -> PreferenceDataset:
    def pair(row: Any) -> tuple[Encoded, Encoded]:
        if len(row) == 2:  # (chosen, rejected) rendered by a chat template
            return (encode_rendered(tokenizer, row[0], max_length, max_prompt_length),
                    encode_rendered(tokenizer, row[1], max_length, max_prompt_length))
        p, c, r = row
        return encode(tokenizer, p, c, max_length, max_prompt_length), encode(tokenizer, p, r, max_length,
                                                                              max_prompt_length)

    pairs = [pair(row) for row in rows]
    prompts = [pair[0].ids[: pair[0].prompt_len] for pair in pairs]
    return PreferenceDataset(pairs, prompts)
