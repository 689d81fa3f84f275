"""One request on its way through the scheduler: its prompt and decoding settings in, text deltas out.

The scheduler thread calls :meth:`Job.feed` after each token; the HTTP handler awaits the job's events on its
asyncio loop. Stop strings (OpenAI ``stop``) are matched on the decoded text: the text ends before the first
match, and text that could still become a stop string is held back from a stream until it cannot.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from crosstrain.generation.config import GenerationConfig
from crosstrain.generation.continuous import Sequence


@dataclass(eq=False)
class Job:
    prompt: list[int]
    config: GenerationConfig
    generator: torch.Generator | None
    stops: tuple[str, ...]
    decode: Any  # token ids -> text
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[tuple[Any, ...]] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    seq: Any = None
    version: Any = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    text: str = ""
    sent: str = ""
    finish_reason: str | None = None
    alternatives: int | None = None  # log-probs asked: that many alternatives per token (Sequence.alternatives)
    score_prompt: bool = False  # echo with log-probs: score the prompt's tokens too (Sequence.score_prompt)

    def _push(self, *event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the server's event loop has closed (shutting down): nobody is listening
            pass

    def started(self, version: Any) -> None:
        self.version = version

    def feed(self, seq: Sequence) -> bool:
        """Take the sequence's tokens so far; push the new text. False once the job is done (a stop token, a stop
        string, or ``max_tokens``)."""
        self.seq = seq
        if self.first_token is None and seq.tokens:
            self.first_token = time.perf_counter()
        text = self.decode([t for t in seq.tokens if t not in seq.config.stop_tokens])
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, self.finish_reason = text[:cut], "stop"
        elif seq.done:
            self.finish_reason = "stop" if seq.stopped else "length"
        self.text = text
        safe = text if self.finish_reason else text[:len(text) - self._held(text)]
        if len(safe) > len(self.sent) and safe.startswith(self.sent):
            self._push("delta", safe[len(self.sent):])
            self.sent = safe
        return self.finish_reason is None

    def _held(self, text: str) -> int:
        """Characters at the end that may still grow into a stop string or complete a multi-byte character."""
        held = min(len(text) - len(text.rstrip("\ufffd")), 4)  # a UTF-8 character is at most 4 bytes
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    held = max(held, n)
                    break
        return held

    def finish(self, seq: Sequence | None) -> None:
        if seq is not None and self.finish_reason is None:
            self.feed(seq)
            self.finish_reason = self.finish_reason or "length"
        self._push("done", self.finish_reason or "length", len(seq.tokens) if seq is not None else 0)

    def fail(self, status: int, message: str) -> None:
        self._push("error", status, message)
