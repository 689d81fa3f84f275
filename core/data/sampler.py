"""A seeded, distributed batch sampler whose position saves and restores exactly.

Every rank computes the same per-epoch permutation (seed + epoch). A step consumes ``global_batch`` samples,
split into ``micro_batches`` contiguous micro-batches; data-parallel rank ``r`` of ``R`` takes the ``r``-th
contiguous slice of each. So the samples of a step, and those of each micro-batch over all ranks together, do
not depend on the layout: 2 ranks see what 1 process with the same ``grad_accum`` sees, micro-batch by
micro-batch (which matters for terms over the whole micro-batch, such as MoE's global balance loss).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from crosstrain.errors import ConfigError


class DistributedBatchSampler:
    def __init__(self, num_samples: int, global_batch: int, *, dp_rank: int = 0, dp_size: int = 1,
                 micro_batches: int = 1, seed: int = 0, shuffle: bool = True) -> None:
        if global_batch % (dp_size * micro_batches):
            raise ConfigError(f"train.batch_size={global_batch} must be divisible by the data-parallel degree "
                              f"({dp_size}) x train.grad_accum ({micro_batches})")
        if num_samples < global_batch:
            raise ConfigError(f"the data has {num_samples} samples, fewer than train.batch_size={global_batch}; "
                              "lower train.batch_size or train.seq_len")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro_batches = micro_batches
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0  # samples of the current epoch already consumed (all ranks together)
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                self._perm = torch.randperm(self.num_samples, generator=gen).numpy()
            else:
                self._perm = np.arange(self.num_samples)
            self._perm_epoch = self.epoch
        assert self._perm is not None
        return self._perm

    def next_step(self) -> list[np.ndarray]:
        """This rank's sample indices for the next step, one array per micro-batch."""
        if self.offset + self.global_batch > self.num_samples:  # drop the ragged tail of the epoch
            self.epoch += 1
            self.offset = 0
        batch = self._permutation()[self.offset : self.offset + self.global_batch]
        self.offset += self.global_batch
        m = self.global_batch // (self.dp_size * self.micro_batches)
        return list(batch.reshape(self.micro_batches, self.dp_size, m)[:, self.dp_rank])

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_samples"]) != self.num_samples:
            raise ConfigError(f"the checkpoint's data had {int(state['num_samples'])} samples, this run has "
                              f"{self.num_samples}; resume with the same data and train.seq_len")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.seed = int(state["seed"])
