"""On-policy distillation (GKD, Agarwal et al. 2024): a fraction ``lambda`` of the micro-batches train on
completions the student samples itself, through :func:`crosstrain.generation.generate`.

Which micro-batches: micro-batch ``i`` of step ``s`` is on-policy when ``u(seed, s, i) < lambda``, a uniform draw
that depends on nothing else, so every rank (FSDP's unshard inside ``generate`` is a collective) and a resumed run
agree. The sampling generator is seeded by ``(seed, s, i, data-parallel rank)``: tensor-parallel ranks sharing a
batch draw the same tokens, and a resumed run draws what the uninterrupted one did.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from crosstrain.generation import GenerationConfig, generate
from crosstrain.plugins.compress.distill.data import DistillBatch


def is_on_policy(fraction: float, seed: int, step: int, micro: int) -> bool:
    """Whether micro-batch ``micro`` of ``step`` samples its completions (module docstring)."""
    if fraction <= 0.0:
        return False
    return fraction >= 1.0 or float(np.random.default_rng([seed, step, micro]).random()) < fraction


def sample_completions(student: nn.Module, batch: DistillBatch, *, temperature: float, max_seq_len: int,
                       generator: torch.Generator, stop_tokens: tuple[int, ...] = ()) -> DistillBatch:
    """``batch`` with each row's tokens after its prompt (``prompt_lengths``) replaced by the student's samples,
    filling the row's ``T`` targets; ``mask`` marks the sampled targets up to and including the row's first stop
    token (:func:`crosstrain.generation.stops.stop_tokens`), as TRL's GKDTrainer masks what follows EOS. Every row
    draws up to the same number of tokens (the longest completion of the batch), so every rank runs the same
    number of forwards until all rows have stopped."""
    width = batch.inputs.shape[1]
    lengths = [max(1, int(n)) for n in batch.prompt_lengths.tolist()]
    rows = batch.inputs.tolist()
    prompts = [row[:n] for row, n in zip(rows, lengths, strict=True)]
    new = min(width + 1 - min(lengths), max_seq_len - max(lengths))
    config = GenerationConfig(max_new_tokens=new, temperature=temperature, stop_tokens=stop_tokens)
    out = generate(student, prompts, config, generator=generator)
    tokens = torch.zeros((len(rows), width + 1), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, (prompt, sampled, n) in enumerate(zip(prompts, out.tokens.tolist(), out.lengths.tolist(), strict=True)):
        seq = (prompt + sampled[:n])[: width + 1]  # the engine pads after a stop: those slots are not samples
        tokens[r, : len(seq)] = torch.tensor(seq)
        mask[r, len(prompt) - 1 : len(seq) - 1] = True
    device = batch.inputs.device
    tokens, mask = tokens.to(device), mask.to(device)
    return dataclasses.replace(batch, inputs=tokens[:, :-1], targets=tokens[:, 1:], mask=mask, document_ids=None)
