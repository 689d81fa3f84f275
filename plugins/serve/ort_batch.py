"""Continuous batching's interface on onnxruntime: the exported graph's cache is one ``past`` length for a whole
batch, so each sequence keeps its own ``present`` arrays and a step runs one session call per live sequence
(sequences still join and leave between steps; only the torch engine shares one forward between them)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from crosstrain.generation.continuous import Sequence, admit, append_next, score_prompt, undoing


class OrtBatch:
    """The :class:`~crosstrain.generation.ContinuousBatch` interface (``add``, ``step``, ``step_alone``, ``drop``,
    ``free``, ``live``) over a :class:`~crosstrain.plugins.export.generate.OrtEngine`."""

    def __init__(self, engine: Any, slots: int) -> None:
        self.engine = engine
        self.slots = slots
        self.max_len = int(engine.config.max_seq_len)
        self.live: list[Sequence] = []
        self._past: dict[int, list[np.ndarray]] = {}

    @property
    def free(self) -> int:
        return self.slots - len(self.live)

    def _forward(self, seq: Sequence, ids: list[int]) -> torch.Tensor:
        """``[1, len(ids), vocab]`` logits; the sequence's cache grows by ``ids``."""
        logits, past = self.engine.forward(np.asarray([ids], dtype=np.int64), self._past[id(seq)])
        self._past[id(seq)] = past
        return torch.from_numpy(np.ascontiguousarray(logits))

    def add(self, seq: Sequence) -> Sequence:
        decodes = admit(seq, self.max_len)
        if not decodes and not seq.score_prompt:
            return seq
        self._past[id(seq)] = self.engine.empty_cache(1)
        logits = self._forward(seq, seq.prompt)
        score_prompt(seq, logits[0])
        if not decodes:
            self._past.pop(id(seq), None)
            return seq
        append_next([seq], logits[:, -1])
        if seq.done:
            self._past.pop(id(seq), None)
        else:
            self.live.append(seq)
        return seq

    def step(self) -> list[Sequence]:
        """One token for every live sequence; a step that raises leaves every sequence and cache as it was."""
        if not self.live:
            return []
        with undoing(self.live), self._keeping_past():
            logits = torch.cat([self._forward(s, [s.tokens[-1]])[:, -1] for s in self.live])
            append_next(self.live, logits)
        return self._leave_done(self.live)

    def step_alone(self, seq: Sequence) -> list[Sequence]:
        """One token for ``seq`` only (as ``ContinuousBatch.step_alone``)."""
        with undoing([seq]), self._keeping_past():
            append_next([seq], self._forward(seq, [seq.tokens[-1]])[:, -1])
        return self._leave_done([seq])

    @contextmanager
    def _keeping_past(self) -> Iterator[None]:
        """Each call returns new ``present`` arrays, so putting back the old ones undoes a step that raised."""
        saved = dict(self._past)
        try:
            yield
        except BaseException:
            self._past = saved
            raise

    def _leave_done(self, seqs: list[Sequence]) -> list[Sequence]:
        finished = [s for s in seqs if s.done]
        for seq in finished:
            self.drop(seq)
        return finished

    def drop(self, seq: Sequence) -> None:
        if seq in self.live:
            self.live.remove(seq)
        self._past.pop(id(seq), None)
        seq.done = True
