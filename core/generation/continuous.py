"""Continuous batching: sequences join a running batch at the next decode step and leave when they are done.

:class:`ContinuousBatch` is the decode loop of :func:`crosstrain.generation.generate` cut at each step, so a
server can interleave arrivals: :meth:`~ContinuousBatch.add` prefills one prompt alone (exactly as ``generate``
does for a single prompt) and picks its first token; :meth:`~ContinuousBatch.step` runs one ``forward_cached``
over every live row of a :class:`~crosstrain.generation.slots.SlotKVCache` (each row at its own position) and
picks each row's next token with ``crosstrain.generation.sampling``, under that sequence's own settings and
generator. A greedy sequence therefore decodes the tokens it decodes alone, whatever else shares its steps
(iteration-level scheduling: Yu et al. 2022, "Orca", OSDI; the scheme of vLLM and TGI).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.generation.config import GenerationConfig
from crosstrain.generation.engine import _check
from crosstrain.generation.logprobs import Alternatives, prompt_logprobs, top_alternatives
from crosstrain.generation.sampling import next_tokens, token_logprobs
from crosstrain.generation.sharded import model_device, unwrap
from crosstrain.generation.slots import SlotKVCache


@dataclass(eq=False)
class Sequence:
    """One prompt being continued. ``tokens``/``logprobs`` grow by one per step; ``done`` once it emitted a stop
    token or ``config.max_new_tokens`` tokens. ``tag`` is the caller's (a request handle).

    ``alternatives`` k (not None): ``top`` also grows by each token's k most likely alternatives. ``score_prompt``:
    the prefill also fills ``prompt_logprobs`` (and ``prompt_top``, k alternatives) for the prompt's tokens, even
    when no token is asked (``max_new_tokens`` 0): OpenAI's ``echo`` with ``logprobs``."""

    prompt: list[int]
    config: GenerationConfig
    generator: torch.Generator | None = None
    tag: Any = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False
    row: int = -1  # its row in the slot cache while live
    alternatives: int | None = None
    score_prompt: bool = False
    top: list[Alternatives] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top: list[Alternatives] = field(default_factory=list)

    @property
    def stopped(self) -> bool:
        """Ended on a stop token (not on the token budget)."""
        return bool(self.tokens) and self.tokens[-1] in self.config.stop_tokens



def admit(seq: Sequence, max_len: int) -> bool:
    """Whether ``seq`` needs decoding: a one-line ConfigError when its prompt is empty or prompt + max_new_tokens
    exceeds ``max_len``; a sequence that asks for no token is marked done (False)."""
    if not seq.prompt:
        raise ConfigError("every prompt needs at least one token")
    total = len(seq.prompt) + seq.config.max_new_tokens
    if total > max_len:
        raise ConfigError(f"prompt ({len(seq.prompt)} tokens) + max_new_tokens {seq.config.max_new_tokens} = "
                          f"{total} exceeds the model's context of {max_len} tokens; shorten the prompt "
                          "or lower max_new_tokens")
    if seq.config.max_new_tokens == 0:
        seq.done = True
        return False
    return True


class ContinuousBatch:
    """Up to ``slots`` sequences decoded together on ``model`` (the cache protocol plus ``max_seq_len``)."""

    def __init__(self, model: nn.Module, slots: int, max_len: int | None = None) -> None:
        if slots < 1:
            raise ConfigError(f"a continuous batch needs at least 1 slot, got {slots}")
        self.model = unwrap(model)
        self.device = model_device(self.model)
        self.max_len = max_len or int(self.model.config.max_seq_len)
        self.cache = SlotKVCache(len(self.model.blocks()), slots, self.max_len)
        self.live: list[Sequence] = []  # live[r] is the sequence in cache row r

    @property
    def free(self) -> int:
        return self.cache.slots - len(self.live)

    @torch.no_grad()
    def add(self, seq: Sequence) -> Sequence:
        """Prefill ``seq.prompt`` alone and pick its first token; it joins the batch unless already done (one token
        asked, or a stop token first). Raises a one-line ConfigError when it cannot fit."""
        _check(self.model, [seq.prompt], seq.config)
        decodes = admit(seq, self.max_len)
        if not decodes and not seq.score_prompt:
            return seq
        if decodes and not self.free:
            raise ValueError("no free slot; wait for a sequence to finish (check .free first)")
        ids = torch.tensor([seq.prompt], dtype=torch.long, device=self.device)
        prefill = self.model.allocate_kv_cache(1, len(seq.prompt), None, self.device)
        positions = torch.arange(len(seq.prompt), device=self.device).unsqueeze(0)
        logits = self.model.forward_cached(ids, positions, prefill, None)
        score_prompt(seq, logits[0])
        if not decodes:
            return seq
        append_next([seq], logits[:, -1])
        if not seq.done:
            seq.row = self.cache.admit(prefill)
            self.live.append(seq)
        return seq

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """One decode step for every live sequence (each gets one more token); returns the sequences that finished
        in it (they have left the batch). A step that raises leaves the batch as it was before it (:func:`undoing`),
        so :meth:`step_alone` can then find the row that fails."""
        if not self.live:
            return []
        with undoing(self.live), self.cache.undoing():
            last = torch.tensor([[s.tokens[-1]] for s in self.live], dtype=torch.long, device=self.device)
            logits = self.model.forward_cached(last, self.cache.positions(self.device), self.cache, None)[:, -1]
            append_next(self.live, logits)
        return self._leave_done(self.live)

    @torch.no_grad()
    def step_alone(self, seq: Sequence) -> list[Sequence]:
        """One decode step for the live ``seq`` only, through a one-row view of the cache: what a server runs row by
        row after :meth:`step` raised, so only a row that fails alone fails. Raises as ``step`` does (nothing
        changed); returns ``[seq]`` when it finished (it has left the batch), else ``[]``."""
        with undoing([seq]), self.cache.alone(seq.row) as view:
            last = torch.tensor([[seq.tokens[-1]]], dtype=torch.long, device=self.device)
            logits = self.model.forward_cached(last, view.positions(self.device), view, None)[:, -1]
            append_next([seq], logits)
        return self._leave_done([seq])

    def _leave_done(self, seqs: list[Sequence]) -> list[Sequence]:
        finished = [s for s in seqs if s.done]
        for seq in finished:
            self.drop(seq)
        return finished

    def drop(self, seq: Sequence) -> None:
        """Take a live sequence out of the batch now (finished, or abandoned by its caller); its row is freed."""
        if seq.row < 0 or seq.row >= len(self.live) or self.live[seq.row] is not seq:
            return
        moved = self.cache.release(seq.row)
        self.live[seq.row] = self.live[-1]
        self.live.pop()
        if moved is not None:
            self.live[seq.row].row = seq.row
        seq.row = -1
        seq.done = True


@contextmanager
def undoing(seqs: list[Sequence]) -> Iterator[None]:
    """Undo a decode step that raises: each sequence's tokens, log-probs, alternatives and ``done`` go back to what
    they were; the exception propagates (the cache has its own: :meth:`SlotKVCache.undoing`)."""
    saved = [(len(s.tokens), len(s.logprobs), len(s.top), s.done) for s in seqs]
    try:
        yield
    except BaseException:
        for seq, (n_tokens, n_logprobs, n_top, done) in zip(seqs, saved, strict=True):
            del seq.tokens[n_tokens:], seq.logprobs[n_logprobs:], seq.top[n_top:]
            seq.done = done
        raise


def score_prompt(seq: Sequence, logits: torch.Tensor) -> None:
    """Fill ``seq.prompt_logprobs``/``prompt_top`` from its prefill's ``logits [len(prompt), vocab]`` when asked."""
    if seq.score_prompt:
        seq.prompt_logprobs, seq.prompt_top = prompt_logprobs(logits, seq.prompt, seq.alternatives or 0)


def append_next(seqs: list[Sequence], logits: torch.Tensor) -> None:
    """Pick the next token of each sequence from its row of ``logits [len(seqs), vocab]`` (greedy rows in one
    argmax; sampled rows one by one under their own settings and generator) and append it with its log-prob (of
    the untempered logits, as ``generate`` reports); mark the sequences that are done."""
    chosen = logits.argmax(dim=-1)
    for i, seq in enumerate(seqs):
        cfg = seq.config
        if not cfg.greedy:
            chosen[i] = next_tokens(logits[i:i + 1], greedy=False, temperature=cfg.temperature, top_k=cfg.top_k,
                                    top_p=cfg.top_p, generator=seq.generator)[0]
    logprobs = token_logprobs(logits.float(), chosen).tolist()
    for i, (seq, token, logprob) in enumerate(zip(seqs, chosen.tolist(), logprobs, strict=True)):
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        if seq.alternatives is not None:
            seq.top.append(top_alternatives(logits[i:i + 1], seq.alternatives)[0])
        seq.done = token in seq.config.stop_tokens or len(seq.tokens) >= seq.config.max_new_tokens
