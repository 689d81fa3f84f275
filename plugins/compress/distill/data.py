"""The distill recipe's data: plain text (the ``lm`` recipe's token windows) or prompt/completion rows (the ``sft``
recipe's, loss on completion tokens only), as one batch type, optionally with the teacher's cached top-k."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from crosstrain.config import Config


@dataclass
class DistillBatch:
    """``inputs``/``targets [B, T]`` (targets: the next token), ``mask [B, T]`` (the targets that count),
    ``prompt_lengths [B]`` (tokens of ``inputs`` an on-policy sample keeps), ``index [B]`` (sample indices), and
    with ``distill.cache`` the teacher's ``teacher_ids``/``teacher_logps [B, T, k]``."""

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    prompt_lengths: torch.Tensor
    index: torch.Tensor
    document_ids: torch.Tensor | None = None
    teacher_ids: torch.Tensor | None = None
    teacher_logps: torch.Tensor | None = None
    teacher_nll: torch.Tensor | None = None  # [B, T], with distill.cache: the teacher's NLL of each target
    sampled: bool = False  # the completions are the student's samples (on-policy)

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        return {} if self.document_ids is None else {"doc_ids": self.document_ids}


class DistillDataset:
    """A text or sft dataset as :class:`DistillBatch` es (``width``: the fixed ``T`` of sft rows, so batches and the
    cache agree on shapes whichever rows they hold)."""

    def __init__(self, base: Any, kind: str, width: int) -> None:
        self.base, self.kind, self.width = base, kind, width
        self.cache: tuple[torch.Tensor, ...] | None = None  # (ids, logps [N, T, k], teacher nll [N, T])

    def __len__(self) -> int:
        return len(self.base)

    def batch(self, indices: Any) -> DistillBatch:
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        if self.kind == "text":
            b = self.base.batch(indices)
            out = DistillBatch(b.inputs, b.targets, torch.ones_like(b.targets, dtype=torch.bool),
                               torch.full((len(idx),), b.inputs.shape[1] // 2), idx, b.document_ids)
        else:
            out = self._sft(indices, idx)
        if self.cache is not None:
            t = out.inputs.shape[1]
            out.teacher_ids = self.cache[0][idx, :t].long()
            out.teacher_logps = self.cache[1][idx, :t].float()
            out.teacher_nll = self.cache[2][idx, :t].float()
        return out

    def _sft(self, indices: Any, idx: torch.Tensor) -> DistillBatch:
        rows = [self.base.rows[int(i)] for i in indices]
        ids = torch.zeros((len(rows), self.width + 1), dtype=torch.long)
        mask = torch.zeros((len(rows), self.width), dtype=torch.bool)
        for r, row in enumerate(rows):
            ids[r, : len(row.ids)] = torch.as_tensor(row.ids)
            mask[r, row.prompt_len - 1 : len(row.ids) - 1] = True  # targets that are completion tokens
        prompts = torch.tensor([row.prompt_len for row in rows])
        return DistillBatch(ids[:, :-1], ids[:, 1:], mask, prompts, idx)


def build(config: Config) -> tuple[DistillDataset, DistillDataset | None, dict[str, Any]]:
    """The train and held-out datasets of ``distill.data`` and how the data was split."""
    kind = config.section("distill").data
    if kind == "text":
        from crosstrain.recipes.lm import LMRecipe

        lm = LMRecipe()  # its checks (tokenizer, packing, vocabulary) and its datasets
        lm.validate(config)
        assert lm.dataset is not None
        width = config.train.seq_len
        held = DistillDataset(lm.eval_dataset, kind, width) if lm.eval_dataset is not None else None
        return DistillDataset(lm.dataset, kind, width), held, lm.split
    from crosstrain.plugins.rlhf.recipes import SFTRecipe

    sft = SFTRecipe()  # data.path rows or the embedded sft task, tokenised and truncated as --recipe sft does
    sft.validate(config)
    width = int(sft.stats["max_length"]) - 1
    split = {"rows": {"train": sft.stats["train_rows"], "eval": sft.stats["eval_rows"]},
             "source": sft.stats["source"]}
    return DistillDataset(sft.dataset, kind, width), DistillDataset(sft.eval_dataset, kind, width), split


def fingerprint(datasets: dict[str, DistillDataset]) -> str:
    """SHA-256 of every sample's tokens and mask, split by split (a cache must have been written for this data)."""
    digest = hashlib.sha256()
    for name in sorted(datasets):
        ds = datasets[name]
        digest.update(f"{name}:{len(ds)}:{ds.kind}".encode())
        for start in range(0, len(ds), 512):
            b = ds.batch(np.arange(start, min(start + 512, len(ds))))
            for t in (b.inputs, b.targets, b.mask):
                digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()
