"""The image dataset the loop draws from: decoded, augmented per sample, in worker processes if asked.

The loop's :class:`~crosstrain.data.sampler.DistributedBatchSampler` picks the positions of each rank's
micro-batches and checkpoints its place (epoch, offset), so the data position resumes exactly like the token
sampler's; the loop tells the dataset the epoch of each step (``set_epoch``). Sample ``k`` of epoch ``e`` is
image ``draws(e)[k]`` (:mod:`.sampling`), transformed with the seed ``(train.seed, e, k)`` (:mod:`.augment`) and
optionally mixed (:mod:`.mix`), so its pixels depend on nothing else. A batch is a dict: ``images`` float32
``[B, C, H, W]``, ``labels`` int64 ``[B]``, and ``targets`` float32 ``[B, K]`` (soft labels) when mixing is on;
host tensors are page-locked where the backend's device benefits (``Device.pin_memory``).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from crosstrain.plugins.vision.data.augment import (
    build_transform,
    eval_transform,
    normalize,
    rng_restored,
    sample_seed,
    seeded,
)
from crosstrain.plugins.vision.data.batched import augment_batch, split_affine_tail
from crosstrain.plugins.vision.data.mix import Mix
from crosstrain.plugins.vision.data.sources import Source

#: seed streams: a sample's augmentation, its mixing plan, its partner's augmentation, the mix; an epoch's draws
AUGMENT, PLAN, PARTNER, MIX, DRAWS = 0, 1, 2, 3, 4


@dataclass
class SampleMaker:
    """Everything that turns ``(epoch, position, image index)`` into pixels. Picklable for worker processes: it
    carries the ``vision.augment`` tables and builds the transform where it runs."""

    source: Source
    augment: list[dict[str, Any]] | None  # None: the held-out images (resize only, no randomness)
    image_size: int
    seed: int
    mean: list[float]
    std: list[float]
    num_classes: int
    mix: Mix = field(default_factory=Mix)
    _transform: Any = field(default=None, repr=False)
    _tail: Any = field(default=None, repr=False)  # (prefix, trailing RandomAffine steps) or False: :mod:`.batched`

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_transform": None, "_tail": None}

    @property
    def transform(self) -> Any:
        if self._transform is None:
            self._transform = (eval_transform(self.image_size) if self.augment is None
                               else build_transform(self.augment, self.image_size))
        return self._transform

    def image(self, i: int, seed: int) -> torch.Tensor:
        """Image ``i`` transformed with ``seed`` (uint8, not yet normalised)."""
        img = self.source.load(i)
        return self.transform(img) if self.augment is None else seeded(self.transform, img, seed)

    @property
    def random(self) -> bool:
        """Whether a sample's pixels depend on its seed (else a batch is transformed at once)."""
        return bool(self.augment) or self.mix.on

    def images(self, indices: np.ndarray) -> torch.Tensor:
        """The images of ``indices`` through the (seed-free) transform, as one batch."""
        batch = self.transform(self.source.load_many(indices)) if self.image_size else self.source.load_many(indices)
        return normalize(batch, self.mean, self.std)

    def many(self, items: list[tuple[int, int, int]]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``[self(*item) for item in items]``; without mixing, an augmentation that ends with ``RandomAffine`` steps
        applies them to the items at once (:mod:`.batched`: the same pixels)."""
        if self._tail is None:
            self._tail = (self.augment is not None and not self.mix.on and split_affine_tail(self.transform)) or False
        if not self._tail or len(items) < 2:
            return [self(*item) for item in items]
        prefix, affines = self._tail
        images = [self.source.load(i) for _, _, i in items]
        seeds = [sample_seed(self.seed, epoch, k, AUGMENT) for epoch, k, _ in items]
        return [(x, None) for x in augment_batch(prefix, affines, images, seeds)]

    def __call__(self, epoch: int, k: int, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        image = self.image(i, sample_seed(self.seed, epoch, k, AUGMENT))
        if self.augment is None or not self.mix.on:
            return image, None  # normalised with its batch
        image = normalize(image.unsqueeze(0), self.mean, self.std)[0]
        onehot = torch.nn.functional.one_hot(torch.tensor(int(self.source.labels[i])), self.num_classes).float()
        plan = self.mix.plan(sample_seed(self.seed, epoch, k, PLAN), len(self.source))
        if plan is None:
            return image, onehot
        method, j = plan
        partner = normalize(self.image(j, sample_seed(self.seed, epoch, k, PARTNER)).unsqueeze(0), self.mean, self.std)
        pair = torch.stack([image, partner[0]])
        labels = torch.tensor([int(self.source.labels[i]), int(self.source.labels[j])])
        return self.mix.apply(method, pair, labels, self.num_classes, sample_seed(self.seed, epoch, k, MIX))


_WORKER: SampleMaker | None = None


def _init_worker(maker: SampleMaker) -> None:
    global _WORKER
    torch.set_num_threads(1)  # the workers share the host with the training process
    _WORKER = maker  # a worker process's own RNG: nothing of the run's to restore


def _make(items: list[tuple[int, int, int]]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    assert _WORKER is not None
    return _WORKER.many(items)


def _make_here(maker: SampleMaker, items: list[tuple[int, int, int]]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    with rng_restored():
        return maker.many(items)


class ImageDataset:
    """``__len__`` / ``batch(indices)`` / ``set_epoch(epoch)`` over a source (module docstring)."""

    def __init__(self, maker: SampleMaker, *, weights: np.ndarray | None = None, workers: int = 0,
                 pin: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.maker, self.weights, self.workers, self.pin = maker, weights, workers, pin
        self.epoch = 0
        self._draws: tuple[int, np.ndarray] | None = None
        self._pool: ProcessPoolExecutor | None = None

    @property
    def labels(self) -> np.ndarray:
        return self.maker.source.labels

    def __len__(self) -> int:
        return len(self.maker.source)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def image_index(self, positions: np.ndarray) -> np.ndarray:
        """The images that sampler positions show this epoch (themselves unless sampling is weighted)."""
        if self.weights is None:
            return np.asarray(positions)
        if self._draws is None or self._draws[0] != self.epoch:
            from crosstrain.plugins.vision.data.sampling import draws

            self._draws = (self.epoch, draws(self.weights, sample_seed(self.maker.seed, self.epoch, 0, DRAWS)))
        return self._draws[1][np.asarray(positions)]

    def batch(self, indices: Any) -> dict[str, torch.Tensor]:
        positions = [int(k) for k in np.asarray(indices)]
        images = self.image_index(np.asarray(positions, dtype=np.int64))
        out = {"labels": torch.from_numpy(self.maker.source.labels[images].astype(np.int64))}
        if not self.maker.random:
            out["images"] = self.maker.images(images)
        else:
            samples = self._run([(self.epoch, k, int(i)) for k, i in zip(positions, images, strict=True)])
            stacked = torch.stack([s[0] for s in samples])
            if samples[0][1] is not None:  # mixed: normalised before mixing
                out["images"] = stacked
                out["targets"] = torch.stack([s[1] for s in samples])  # type: ignore[misc]
            else:
                out["images"] = normalize(stacked, self.maker.mean, self.maker.std)
        return {k: self.pin(v) for k, v in out.items()} if self.pin is not None else out

    def _run(self, items: list[tuple[int, int, int]]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        if self.workers <= 0 or len(items) < 2:
            return _make_here(self.maker, items)
        if self._pool is None:  # spawned once: a fork of a process that runs torch's thread pools can hang
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker, initargs=(self.maker,))
        chunks = [items[w::self.workers] for w in range(self.workers)]
        done = [self._pool.submit(_make, c) for c in chunks if c]
        results = [f.result() for f in done]
        out: list[Any] = [None] * len(items)
        for w, part in enumerate(results):
            out[w::self.workers] = part
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
