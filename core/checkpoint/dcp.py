"""The checkpointer: ``torch.distributed.checkpoint`` with an atomic, checksummed commit.

Folder layout of one checkpoint (``step_N/``)::

    __R_I.distcp     DCP tensor shards written by rank R (tensors only)
    .metadata        DCP metadata (read back through a restricted unpickler)
    meta.json        rank 0: step, world size, JSON skeleton of the global state (scalars, structure)
    rankR.json       rank R: JSON skeletons of its RankLocal state and of its own part of the global state
    manifest.json    SHA-256 and size of every file above; written last

Commit: every rank writes into ``step_N.tmp/`` (fsync per file), the per-rank file hashes are gathered to
rank 0, which writes the manifest, fsyncs the folder, renames it to ``step_N/`` and fsyncs the parent.
A crash at any instant leaves either no ``step_N/`` or a complete one.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from crosstrain.checkpoint import space
from crosstrain.checkpoint.app_state import ModelOptimizerState, RankLocal
from crosstrain.checkpoint.atomic import fsync_dir
from crosstrain.checkpoint.manifest import (
    FORMAT_VERSION,
    META_FILE,
    Manifest,
    read_json_object,
    write_durable,
)
from crosstrain.checkpoint.safe_io import (
    HashingFileSystemWriter,
    SafeFileSystemReader,
    SafeLoadPlanner,
    call_dcp,
    read_metadata,
    without_zip_crc32,
)
from crosstrain.checkpoint.tree import TENSOR_TAG, flatten, unflatten
from crosstrain.errors import CheckpointError

# DCP's note when used without a process group (our single-process mode is intentional). A global filter,
# not catch_warnings(), because saves also run on a background thread and catch_warnings is not thread-safe.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped or only partly restored (the message says why)."""


def local_key(rank: int) -> str:
    return f"__rank{rank}__"


def _rank_world(group: Any) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _is_stateful(obj: Any) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")


def _tensor_paths(skeleton: Any) -> list[str]:
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if set(node) == {TENSOR_TAG}:
                out.append(node[TENSOR_TAG])
                return
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(skeleton)
    return out


@dataclass
class Prepared:
    """A state captured for saving: flat tensors for DCP plus JSON skeletons."""

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    local: dict[str, Any] | None
    extra_files: dict[str, bytes] = field(default_factory=dict)


class DCPCheckpointer:
    """Sharded checkpoints through DCP. Every rank of ``process_group`` calls save/load with its shards;
    loading never executes pickled code, and a crash leaves ``path`` complete or absent."""

    #: the DCP storage writer class, called as ``writer_factory(folder, thread_count=N)``; it must record
    #: ``digests`` for the manifest like :class:`HashingFileSystemWriter`. Backends subclass to change storage;
    #: tests substitute one that fails, to inject storage faults.
    writer_factory: Any = HashingFileSystemWriter
    #: the DCP storage reader class, called as ``reader_factory(folder)``; it must refuse pickled items.
    reader_factory: Any = SafeFileSystemReader

    def __init__(self, process_group: Any = None, *, thread_count: int = 1) -> None:
        self.group = process_group
        self.thread_count = thread_count

    # -- saving ---------------------------------------------------------------------------------------
    def prepare(self, state: Mapping[str, Any], step: int) -> Prepared:
        """Call each entry's ``state_dict()`` and split it into DCP tensors and JSON skeletons."""
        rank, world = _rank_world(self.group)
        global_tree: dict[str, Any] = {}
        local_tree: dict[str, Any] = {}
        kinds: dict[str, str] = {}
        for key, obj in state.items():
            if "." in key or key.startswith("__"):
                raise CheckpointError(f"checkpoint state key {key!r} may not contain '.' or start with '__'")
            if isinstance(obj, RankLocal):
                local_tree[key], kinds[key] = obj.state_dict(), "rank_local"
            elif isinstance(obj, ModelOptimizerState):
                global_tree[key], kinds[key] = obj.state_dict(), "model_optimizer"
            elif _is_stateful(obj):
                global_tree[key], kinds[key] = obj.state_dict(), "stateful"
            elif isinstance(obj, Mapping):
                global_tree[key], kinds[key] = dict(obj), "dict"
            else:
                raise CheckpointError(
                    f"checkpoint entry {key!r} is a {type(obj).__name__}; use a dict or an object with "
                    "state_dict()/load_state_dict()")
        tensors, skeleton = flatten(global_tree)
        local_tensors, local_skeleton = flatten({local_key(rank): local_tree})
        tensors.update(local_tensors)
        model_keys = [k for k, kind in kinds.items() if kind == "model_optimizer"]
        meta = {"format": FORMAT_VERSION, "step": int(step), "world_size": world, "kinds": kinds,
                "model_prefix": f"{model_keys[0]}.model." if model_keys else None, "global": skeleton}
        # Every rank keeps its own skeleton of the global state too: under pipeline parallelism each stage holds
        # different modules, so rank 0's skeleton does not describe the other stages.
        local = {"rank": rank, "tree": local_skeleton[local_key(rank)] if local_tree else {}, "global": skeleton}
        return Prepared(step=int(step), tensors=tensors, meta=meta, local=local)

    def write(self, prepared: Prepared, path: str | os.PathLike[str], *, group: Any = None,
              on_commit: Callable[[Path, Manifest], None] | None = None,
              failed: BaseException | None = None) -> Manifest | None:
        """Write and atomically commit ``prepared`` to ``path`` (collective over ``group``).

        Rank 0 runs ``on_commit(path, manifest)`` after the rename. Every rank takes part in every
        collective of the protocol even after a local failure, so a failure on any rank (here or inside DCP,
        which exchanges its own errors) raises :class:`CheckpointError` on all ranks instead of leaving the
        others blocked. ``failed``: this rank could not prepare its part (staging failed); it is reported at
        the first agreement. Returns the manifest on rank 0, ``None`` elsewhere.
        """
        group = self.group if group is None else group
        rank, world = _rank_world(group)
        distributed = dist.is_initialized() and world > 1
        final = Path(path)
        tmp = final.with_name(final.name + ".tmp")

        def exchange(payload: Any) -> list[Any]:
            if not distributed:
                return [payload]
            out: list[Any] = [None] * world
            dist.all_gather_object(out, payload, group=group)
            return out

        needed = space.estimate_bytes(prepared.tensors)

        def raise_failed(r: int, what: str, e: str, cause: BaseException | None) -> None:
            # whatever failed, the partial folder goes: on a full disk it holds the space a retry needs
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if space.looks_like_no_space(e, final.parent, needed):
                raise space.no_space(final.parent, needed, rank=r if distributed else None) from cause
            raise CheckpointError(f"saving {final} failed on rank {r} while {what}: {e}") from cause

        def agree(error: BaseException | None, what: str) -> None:
            errors = exchange(None if error is None else f"{type(error).__name__}: {error}")
            for r, e in enumerate(errors):
                if e is not None:
                    raise_failed(r, what, e, error)

        error: BaseException | None = failed or space.check(final.parent, needed)
        if rank == 0 and error is None:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            except OSError as exc:
                error = exc
        agree(error, "preparing (staging to host memory, creating the folder)")
        writer = self.writer_factory(tmp, thread_count=self.thread_count)
        try:
            with without_zip_crc32():
                call_dcp(f"saving {final}", dcp.save, prepared.tensors, storage_writer=writer, process_group=group,
                         no_dist=not distributed)
        except CheckpointError as exc:  # DCP told every rank which rank failed
            raise_failed(getattr(exc, "rank", rank), "writing tensors", getattr(exc, "detail", str(exc)), None)
        files = {name: {"sha256": d, "bytes": n} for name, (d, n) in writer.digests.items()}
        try:
            if prepared.local is not None:
                name = f"rank{rank}.json"
                d, n = write_durable(tmp / name, json.dumps(prepared.local, sort_keys=True).encode())
                files[name] = {"sha256": d, "bytes": n}
            if rank == 0:
                d, n = write_durable(tmp / META_FILE, json.dumps(prepared.meta, sort_keys=True).encode())
                files[META_FILE] = {"sha256": d, "bytes": n}
        except OSError as exc:
            error = exc
        gathered = exchange((files, None if error is None else f"{type(error).__name__}: {error}"))
        for r, (_, e) in enumerate(gathered):
            if e is not None:
                raise_failed(r, "writing JSON", e, error)
        manifest = None
        if rank == 0:
            try:
                merged: dict[str, Any] = {}
                for part, _ in gathered:
                    merged.update(part)
                manifest = Manifest(step=prepared.step, world_size=world, files=merged)
                manifest.write(tmp)
                commit_folder(tmp, final)
                if on_commit is not None:
                    on_commit(final, manifest)
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                error = exc
        agree(error, "committing")
        return manifest

    def save(self, state: Mapping[str, Any], path: str | os.PathLike[str], *, step: int = 0) -> None:
        """Write ``state`` under ``path`` and return once it is committed (:class:`CheckpointManager` saves in the
        background by calling :meth:`prepare` and :meth:`write` itself)."""
        self.write(self.prepare(state, step), path)

    # -- loading --------------------------------------------------------------------------------------
    def load(self, path: str | os.PathLike[str], state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Load into ``state`` (in place: Statefuls get ``load_state_dict``, dicts are updated).

        Returns ``{"step": int}`` plus, when ``state`` is None, nothing else (use :func:`load_consolidated`).
        """
        if state is None:
            raise CheckpointError("DCPCheckpointer.load needs the target state; use load_consolidated for tensors")
        return {"step": self.load_into(path, state)}

    def load_into(self, path: str | os.PathLike[str], state: Mapping[str, Any], *, group: Any = None) -> int:
        group = self.group if group is None else group
        rank, world = _rank_world(group)
        folder = Path(path)
        meta = read_meta(folder)
        md = read_metadata(folder)
        saved_world = int(meta["world_size"])
        local_saved: dict[str, Any] = {}
        global_saved: dict[str, Any] = meta["global"]
        rank_file = folder / f"rank{rank}.json"
        if saved_world == world and rank_file.exists():
            rank_meta = _read_json(rank_file)
            local_saved = rank_meta.get("tree", {})
            global_saved = rank_meta.get("global", global_saved)  # this rank's own layout (pipeline stages differ)
        if saved_world != world and any(isinstance(o, RankLocal) for o in state.values()):
            warnings.warn(f"checkpoint {folder} was saved by {saved_world} ranks, this job has {world}: "
                          "per-rank state (RNG, sampler) is not restored", CheckpointWarning, stacklevel=3)
        dcp_sd: dict[str, torch.Tensor] = {}
        pending: list[tuple[str, Any, Any]] = []
        for key, obj in state.items():
            is_local = isinstance(obj, RankLocal)
            if is_local and saved_world != world:
                continue
            skeleton = (local_saved if is_local else global_saved).get(key)
            if skeleton is None:
                warnings.warn(f"checkpoint {folder} has no entry {key!r}; keeping its current state",
                              CheckpointWarning, stacklevel=3)
                continue
            current = obj.state_dict() if _is_stateful(obj) else dict(obj)
            prefix_tree = {local_key(rank): {key: current}} if is_local else {key: current}
            current_tensors, _ = flatten(prefix_tree)
            saved_paths = _tensor_paths(skeleton)
            optional = tuple(f".{key}.{name}" for name in getattr(obj, "optional_entries", ()))
            missing = sorted(p for p in set(current_tensors) - set(saved_paths) if not p.endswith(optional))
            if missing:
                raise CheckpointError(f"checkpoint {folder} lacks {len(missing)} tensors of {key!r} "
                                      f"(e.g. {missing[0]}); it was saved from a different model or optimizer")
            for p in saved_paths:
                entry = md.state_dict_metadata.get(p)
                if not isinstance(entry, TensorStorageMetadata):
                    raise CheckpointError(f"checkpoint {folder} has no tensor data for {p!r}")
                target = current_tensors.get(p)
                if target is not None and tuple(target.shape) == tuple(entry.size):
                    dcp_sd[p] = target
                elif target is not None:
                    raise CheckpointError(f"shape mismatch at {p}: checkpoint {tuple(entry.size)} vs "
                                          f"model {tuple(target.shape)}; check model and parallel settings")
                else:
                    dcp_sd[p] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            pending.append((key, obj, skeleton))
        distributed = dist.is_initialized() and world > 1
        call_dcp(f"loading {folder}", dcp.load, dcp_sd, storage_reader=self.reader_factory(folder),
                 planner=SafeLoadPlanner(), process_group=group, no_dist=not distributed)
        for key, obj, skeleton in pending:
            tree = unflatten(skeleton, dcp_sd)
            if _is_stateful(obj):
                try:
                    obj.load_state_dict(tree)
                except CheckpointError:
                    raise
                except Exception as exc:
                    raise CheckpointError(f"cannot restore {key!r} from {folder}: {type(exc).__name__}: {exc}") \
                        from None
            else:
                obj.clear()  # type: ignore[attr-defined]
                obj.update(tree)  # type: ignore[attr-defined]
        return int(meta["step"])

    def exists(self, path: str | os.PathLike[str]) -> bool:
        from crosstrain.checkpoint.verify import verify

        return verify(path, checksums=False).ok


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, missing="the checkpoint is incomplete")


def read_meta(folder: Path) -> dict[str, Any]:
    meta = _read_json(folder / META_FILE)
    for k in ("step", "world_size", "global"):
        if k not in meta:
            raise CheckpointError(f"{folder / META_FILE} lacks {k!r}")
    return meta


def commit_folder(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` folder to ``final`` (moving an existing one aside first), durably."""
    aside = final.with_name(final.name + ".old")
    if final.exists():
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)
