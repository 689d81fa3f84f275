"""Precomputed DPO reference log-probs (``rlhf.reference = "precomputed"``), cached in the run dir.

As TRL's ``precompute_ref_log_probs``: the summed completion log-probs of the starting weights are computed once,
before the first step, so no reference model is held during training. They are computed just before the first
batch (the policy is parallelised by then and has not stepped): the pairs are split into 32-row chunks dealt out
to the data-parallel ranks, then all-gathered, so every rank holds every row and 1 or N ranks give the same numbers.

Rank 0 writes ``<run dir>/reference_logps.safetensors`` (``train`` and ``eval`` ``[N, 2]`` fp32, chosen then
rejected) and then ``reference_logps.json``, each atomically (temp file, fsync, rename); the json is written last
and records the SHA-256 of the starting weights, of the tokenised pairs, of the options that change the numbers
and of the safetensors file. A restart reads the cache when all of them match. A cache that does not match (other
``model.init_from`` weights, data, ``rlhf.max_length`` ...) is recomputed with a warning on a fresh run, as TRL's
fingerprinted dataset cache would; on resume the starting weights are gone, so it is a one-line error.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.plugins.rlhf.data import PreferenceDataset
from crosstrain.plugins.rlhf.lora import adapters_disabled
from crosstrain.plugins.rlhf.losses import sequence_logps

CACHE = "reference_logps.safetensors"
META = "reference_logps.json"
CHUNK = 32


def data_sha256(datasets: dict[str, PreferenceDataset]) -> str:
    """SHA-256 of the tokenised pairs (ids and prompt lengths, in order) of every split."""
    digest = hashlib.sha256()
    for name in sorted(datasets):
        digest.update(f"{name}:{len(datasets[name])}".encode())
        for pair in datasets[name].pairs:
            for seq in pair:
                digest.update(np.asarray([len(seq.ids), seq.prompt_len], dtype=np.int64).tobytes())
                digest.update(np.ascontiguousarray(seq.ids, dtype=np.int64).tobytes())
    return digest.hexdigest()


def logps_sha256(tables: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the log-prob tables (the value checkpoints keep to detect a different reference on resume)."""
    digest = hashlib.sha256()
    for name in sorted(tables):
        digest.update(tables[name].float().contiguous().numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def compute(model: nn.Module, datasets: dict[str, PreferenceDataset], device: torch.device, dp_rank: int,
            dp_size: int) -> dict[str, torch.Tensor]:
    """``{split: [N, 2]}`` summed completion log-probs of ``model`` with its adapters off, in eval mode.

    Every rank runs the same number of forwards (sharded models all-gather in step): a rank short of chunks
    repeats the first one and drops the result.
    """
    jobs = [(name, start) for name in sorted(datasets) for start in range(0, len(datasets[name]), CHUNK)]
    mine = jobs[dp_rank::dp_size]
    parts: dict[tuple[str, int], torch.Tensor] = {}
    was_training = model.training
    model.eval()
    try:
        with adapters_disabled(model):
            for i in range(math.ceil(len(jobs) / dp_size)):
                name, start = mine[i] if i < len(mine) else jobs[0]
                ds = datasets[name]
                batch = ds.sequences(list(range(start, min(start + CHUNK, len(ds)))))
                ids, mask = batch["input_ids"].to(device), batch["loss_mask"][:, 1:].to(device)
                logps, _ = sequence_logps(model(ids[:, :-1]), ids[:, 1:], mask)
                if i < len(mine):
                    parts[(name, start)] = torch.stack(logps.float().cpu().chunk(2), dim=1)
    finally:
        model.train(was_training)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, parts)
        for other in gathered:
            parts.update(other)
    return {name: torch.cat([parts[(name, s)] for s in range(0, len(ds), CHUNK)]) for name, ds in datasets.items()}


def read(run_dir: Path, fingerprint: dict[str, Any]) -> tuple[dict[str, torch.Tensor] | None, str]:
    """The cached tables if the cache matches ``fingerprint``, else None and why not."""
    from safetensors.torch import load

    meta_path, cache_path = run_dir / META, run_dir / CACHE
    if not meta_path.is_file():
        return None, "no cache"
    try:
        meta = json.loads(meta_path.read_text())
        data = cache_path.read_bytes()
    except (OSError, ValueError) as exc:
        return None, f"unreadable ({exc})"
    changed = [k for k, v in fingerprint.items() if meta.get(k) != v]
    if changed:
        return None, f"stale ({', '.join(changed)} changed)"
    if hashlib.sha256(data).hexdigest() != meta.get("file_sha256"):
        return None, f"{CACHE} does not match its checksum"
    return load(data), "cache"


def write(run_dir: Path, tables: dict[str, torch.Tensor], fingerprint: dict[str, Any]) -> None:
    """The tables, then the json naming their checksum (a crash in between leaves a cache that reads as stale)."""
    from safetensors.torch import save

    from crosstrain.checkpoint.atomic import atomic_write

    data = save({k: v.contiguous() for k, v in tables.items()})
    atomic_write(run_dir / CACHE, data)
    meta = {**fingerprint, "file_sha256": hashlib.sha256(data).hexdigest(), "logps_sha256": logps_sha256(tables),
            "rows": {k: int(v.shape[0]) for k, v in tables.items()}}
    atomic_write(run_dir / META, (json.dumps(meta, indent=2) + "\n").encode())


class PrecomputedReference:
    """Fills ``reference_logps`` of the recipe's datasets before their first batch, from the cache or one pass."""

    def __init__(self, context: Any, policy: nn.Module, datasets: dict[str, PreferenceDataset],
                 options: dict[str, Any]) -> None:
        from crosstrain.engine.models import frozen_sha256

        self.context = context
        self.datasets = datasets
        self.checksum = ""  # logps_sha256 of the tables, once filled
        self.resumed_checksum: str | None = None  # the checkpoint's, on resume
        # the starting weights, hashed while still whole on every rank (before any transform or sharding)
        self.fingerprint = {"weights_sha256": frozen_sha256(policy), "data_sha256": data_sha256(datasets),
                            "options": options}
        for ds in datasets.values():
            ds.fill_reference = self.fill

    def fill(self) -> None:
        from crosstrain.parallel import dp_rank_and_size

        ctx = self.context
        if ctx.run_dir is None:
            raise ConfigError("rlhf.reference='precomputed' reads the reference log-probs of the run's start from "
                              "its run dir; evaluate with --set rlhf.reference=frozen")
        run_dir = Path(ctx.run_dir)
        tables, status = read(run_dir, self.fingerprint)
        resumed = ctx.resume_step > 0
        if tables is None and resumed:
            raise ConfigError(f"resuming at step {ctx.resume_step} needs {run_dir / CACHE}, but it is {status}; the "
                              "starting weights are gone: restore the cache or start a new run dir")
        if tables is None:
            if status != "no cache":
                ctx.emit_event("reference_logps_stale", message=f"crosstrain: warning: the reference log-prob cache "
                               f"in {run_dir} is {status}; recomputing it", reason=status)
            rank, size = dp_rank_and_size(ctx.mesh, ctx.dims)
            tables = compute(ctx.models["policy"], self.datasets, ctx.device, rank, size)
            if ctx.is_main:
                write(run_dir, tables, self.fingerprint)
            status = "computed"
        self.checksum = logps_sha256(tables)
        if self.resumed_checksum is not None and self.resumed_checksum != self.checksum:
            raise ConfigError("the precomputed reference log-probs differ from the checkpoint's (stale: other "
                              "model.init_from weights or data); resume with the original ones or a new run dir")
        ctx.emit_event("reference_logps", source=status, sha256=self.checksum,
                       rows={k: int(v.shape[0]) for k, v in tables.items()})
        for name, ds in self.datasets.items():
            ds.reference_logps = tables[name]
            ds.fill_reference = None


class ReferenceChecksum:
    """Checkpointed SHA-256 of the reference log-probs: resuming with different ones is a one-line error."""

    def __init__(self, reference: PrecomputedReference) -> None:
        self.reference = reference

    def state_dict(self) -> dict[str, Any]:
        return {"sha256": self.reference.checksum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reference.resumed_checksum = str(state.get("sha256", ""))
