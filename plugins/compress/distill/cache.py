"""The offline teacher: its top-k log-probs over every train and held-out sample, computed once and read back.

``crosstrain distill cache TEACHER --out FILE`` writes one safetensors file: ``train_ids``/``train_logps`` and
``eval_ids``/``eval_logps`` (``[N, T, k]``: int32 token ids, fp32 log-probs of the full softmax at
``distill.temperature``), ``train_nll``/``eval_nll`` (``[N, T]`` fp32, the teacher's NLL of each target at
temperature 1, for the side-by-side eval) and, as string metadata, the teacher's source and SHA-256, the data's
fingerprint, k, the temperature and ``payload_sha256``, the SHA-256 of the tensors in name order (the checksum the
reader verifies).
The file is written to a temporary name and renamed, so a crash leaves no half-written cache.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.plugins.compress.distill.data import DistillDataset
from crosstrain.plugins.compress.distill.losses import teacher_topk

FORMAT = "crosstrain.distill_cache/1"
BATCH = 16


def payload_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the tensors' names, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def compute(teacher: nn.Module, dataset: DistillDataset, k: int, temperature: float, device: torch.device,
            on_batch: Callable[[int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids int32, logps fp32) [N, T, k]``: the teacher's top-k at every position of every sample, and its
    NLL of each target ``[N, T]``; ``on_batch(samples_done)`` after each batch (the CLI's progress lines)."""
    import torch.nn.functional as F

    ids, logps, nll = [], [], []
    for start in range(0, len(dataset), BATCH):
        b = dataset.batch(np.arange(start, min(start + BATCH, len(dataset))))
        logits = teacher(b.inputs.to(device), **{k_: v.to(device) for k_, v in b.model_kwargs().items()})
        top = teacher_topk(logits, k, temperature)
        ids.append(top.ids.to(torch.int32).cpu())
        logps.append(top.logps.float().cpu())
        nll.append(F.cross_entropy(logits.float().transpose(1, 2), b.targets.to(device), reduction="none").cpu())
        if on_batch is not None:
            on_batch(min(start + BATCH, len(dataset)))
    return torch.cat(ids), torch.cat(logps), torch.cat(nll)


def write(out: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
    """Write the cache atomically; returns its payload SHA-256."""
    from safetensors.torch import save

    from crosstrain.checkpoint.atomic import atomic_write

    checksum = payload_sha256(tensors)
    header = {"format": FORMAT, "payload_sha256": checksum, **{k: json.dumps(v) for k, v in meta.items()}}
    atomic_write(out, save({k: v.contiguous() for k, v in tensors.items()}, metadata=header))
    return checksum


class Cache:
    """A cache file read back and verified: its tensors, its metadata (decoded) and checksum."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"distill.cache {path} does not exist; write it with `crosstrain distill cache "
                              "TEACHER --out FILE`")
        try:
            with safe_open(str(p), framework="pt") as fh:
                header = fh.metadata() or {}
                self.tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        except Exception as exc:
            raise ConfigError(f"distill.cache {path} is not a readable safetensors file ({exc}); write it again "
                              "with `crosstrain distill cache`") from exc
        if header.get("format") != FORMAT:
            raise ConfigError(f"distill.cache {path} is not a distillation cache (format {header.get('format')!r}); "
                              "write it with `crosstrain distill cache`")
        self.checksum = header["payload_sha256"]
        if payload_sha256(self.tensors) != self.checksum:
            raise ConfigError(f"distill.cache {path} does not match its checksum (corrupt or edited); write it again "
                              "with `crosstrain distill cache`")
        self.meta = {k: json.loads(v) for k, v in header.items() if k not in ("format", "payload_sha256")}
        self.path = str(p.resolve())

    def check(self, data_sha256: str, temperature: float, vocab_size: int) -> None:
        """One-line errors when the cache was written for other data, temperature or vocabulary."""
        wanted = {"data_sha256": data_sha256, "temperature": temperature, "vocab_size": vocab_size}
        for key, value in wanted.items():
            if self.meta.get(key) != value:
                raise ConfigError(f"distill.cache {self.path} was written for another {key.replace('_sha256', '')} "
                                  f"({self.meta.get(key)!r}, this run has {value!r}); write the cache again with "
                                  "this run's --config/--set")

    def check_teacher(self, source: str, sha256: str) -> None:
        """With ``distill.teacher`` set beside ``distill.cache``, the cache must hold that teacher's output (the same
        weights, by SHA-256): a cache of another teacher would train silently on the wrong targets."""
        wrote, wrote_sha = self.meta.get("teacher_source"), str(self.meta.get("teacher_sha256"))
        if wrote_sha != sha256:
            raise ConfigError(f"distill.cache {self.path} was written by teacher {wrote} (sha256 {wrote_sha[:12]}...) "
                              f"but distill.teacher is {source} (sha256 {sha256[:12]}...); rebuild the cache with "
                              f"`crosstrain distill cache {source} --out {self.path}` and this run's --config/--set, "
                              "or unset distill.teacher")

    def split(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tensors[f"{name}_ids"], self.tensors[f"{name}_logps"], self.tensors[f"{name}_nll"]

    def record(self) -> dict[str, Any]:
        """summary.json's teacher record for a cached teacher."""
        return {"source": self.meta.get("teacher_source"), "sha256": self.meta.get("teacher_sha256"),
                "vocab_size": self.meta.get("vocab_size"), "cache": self.path, "cache_sha256": self.checksum,
                "top_k": self.meta.get("top_k")}


class CacheChecksum:
    """Checkpointed checksum of the cache a run reads: resuming with another cache is a one-line error."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    def state_dict(self) -> dict[str, Any]:
        return {"sha256": self.cache.checksum, "teacher_sha256": self.cache.meta.get("teacher_sha256")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("sha256") != self.cache.checksum:
            from crosstrain.errors import CheckpointError

            raise CheckpointError(f"distill.cache {self.cache.path} differs from the cache this checkpoint was trained "
                                  f"with (sha256 {str(state.get('sha256'))[:12]}..., now {self.cache.checksum[:12]}"
                                  "...); resume with the same cache or start a new run dir")
