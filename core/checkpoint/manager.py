"""CheckpointManager: step-numbered checkpoints in one folder, async saves, ``latest``, retention, resume.

Layout: ``<folder>/step_N/`` (committed, see :mod:`crosstrain.checkpoint.dcp`), ``<folder>/latest`` (a text
file naming the newest committed ``step_N``, replaced atomically after each commit).

Every rank constructs the manager and calls ``save``/``wait``/``check_background``/``load``/``close`` at
the same points. ``latest()`` only reads files and may be called anywhere.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import shutil
import warnings
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from crosstrain.checkpoint.atomic import atomic_write, is_temp
from crosstrain.checkpoint.backend_storage import backend_checkpointer
from crosstrain.checkpoint.dcp import CheckpointWarning, Prepared
from crosstrain.checkpoint.manifest import Manifest
from crosstrain.checkpoint.retention import to_delete
from crosstrain.checkpoint.staging import HostStager
from crosstrain.checkpoint.verify import verify
from crosstrain.errors import CheckpointError

if TYPE_CHECKING:
    from crosstrain.backend import Backend

log = logging.getLogger("crosstrain.checkpoint")

LATEST_FILE = "latest"
BEST_FILE = "best"  # names the checkpoint with the best eval loss (checkpoint.keep_best)
_STEP_RE = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint: its step and folder; ``verified`` when its checksums were just checked."""

    step: int
    path: Path
    verified: bool = False

    @property
    def name(self) -> str:
        return self.path.name


def step_dirs(folder: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Committed-looking ``step_N`` folders under ``folder``, newest first (not verified)."""
    root = Path(folder)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir():
            out.append((int(m.group(1)), child))
    return sorted(out, key=lambda sp: -sp[0])


def step_number(name: str) -> int | None:
    """N for a ``step_N`` folder name, else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def looks_like_step_dir(path: Path) -> bool:
    """``step_N`` or an uncommitted ``step_N.tmp``: a checkpoint folder, not a folder of them."""
    return bool(_STEP_RE.match(path.name) or _STEP_RE.match(path.name.removesuffix(".tmp")))


def read_pointer(folder: str | os.PathLike[str], name: str) -> str | None:
    """The ``step_N`` name a pointer file (``latest``, ``best``) holds, or None."""
    try:
        return (Path(folder) / name).read_text().strip() or None
    except (OSError, UnicodeDecodeError):  # gone, or garbage bytes: no pointer (best_problem says which)
        return None


def read_latest_pointer(folder: str | os.PathLike[str]) -> str | None:
    return read_pointer(folder, LATEST_FILE)


def find_best(folder: str | os.PathLike[str]) -> CheckpointInfo | None:
    """The checkpoint ``best`` names (``checkpoint.keep_best``), verified, or None if there is none or it is bad."""
    name = read_pointer(folder, BEST_FILE)
    match = _STEP_RE.match(name or "")
    if not match:
        return None
    path = Path(folder) / str(name)
    return CheckpointInfo(int(match.group(1)), path, True) if verify(path).ok else None


def best_problem(folder: str | os.PathLike[str]) -> str:
    """Why :func:`find_best` found nothing under ``folder``, with the fix (for a one-line error)."""
    pointer = Path(folder) / BEST_FILE
    if not pointer.exists():
        return "no best checkpoint (train with checkpoint.keep_best=true)"
    name = read_pointer(folder, BEST_FILE)
    if not _STEP_RE.match(name or ""):
        return (f"a best pointer {pointer} that names no step_N folder (it is corrupt); delete it, or write the "
                "step_N name of the checkpoint to use into it")
    problems = verify(Path(folder) / str(name)).problems or ["it is missing"]
    return (f"a best pointer {pointer} naming {name}, which is unusable ({problems[0]}); drop --best, or write "
            "the step_N name of a valid checkpoint into it")


def first_valid(candidates: list[tuple[int, Path]], problems_of: Callable[[Path], list[str]], *,
                warn: bool = True) -> CheckpointInfo | None:
    """The first of ``candidates`` (newest first) without problems; others are skipped with a warning saying why."""
    for step, path in candidates:
        problems = problems_of(path)
        if not problems:
            return CheckpointInfo(step=step, path=path, verified=True)
        if warn:
            msg = f"skipping checkpoint {path}: {'; '.join(problems)}"
            log.warning(msg)
            warnings.warn(msg, CheckpointWarning, stacklevel=3)
    return None


def find_latest(folder: str | os.PathLike[str], *, warn: bool = True) -> CheckpointInfo | None:
    """The newest checkpoint under ``folder`` that verifies; others are skipped with a warning saying why."""
    return first_valid(step_dirs(folder), lambda path: verify(path).problems, warn=warn)


class CheckpointManager:
    """Saves ``step_N`` checkpoints of a state dict of Statefuls/dicts into ``folder``.

    ``async_save``: ``save`` stages tensors to host memory (pinned when the device supports it) and
    returns (or returns at once and stages on the background thread up to :meth:`fence`, see
    :meth:`save`); a background thread writes and commits. At most one save is in flight; a failure surfaces
    from the next ``save``/``wait``/``check_background`` on every rank (agreed with an all-reduce).

    Bytes are written and read through ``backend.checkpointer()`` (default: the active backend's), so a
    backend's storage is used for every trainer checkpoint.
    """

    def __init__(self, folder: str | os.PathLike[str], *, keep_last: int = 3, keep_every: int = 0,
                 async_save: bool = False, collective: Any = None, thread_count: int = 1,
                 timeout_s: float | None = None, backend: Backend | None = None) -> None:
        self.folder = Path(folder)
        self.keep_last = int(keep_last)
        self.keep_every = int(keep_every)
        self.async_save = bool(async_save)
        self.collective = collective
        self.folder.mkdir(parents=True, exist_ok=True)
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if timeout_s is None:
            timeout = getattr(collective, "timeout", None) or datetime.timedelta(minutes=10)
        else:
            timeout = datetime.timedelta(seconds=timeout_s)
        # DCP exchanges plans and our hashes as objects: use CPU (gloo) groups of our own, so a background
        # save never shares a group with the training loop's collectives.
        self._group = dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None
        self._bg_group = (dist.new_group(backend="gloo", timeout=timeout)
                          if self.distributed and self.async_save else None)
        # the backend's storage (default: the active backend's; the core's DCP checkpointer unless it overrides it)
        self._checkpointer = backend_checkpointer(backend, self._group, thread_count=thread_count)
        # async: a writer thread writes and commits; a helper thread stages (fence() waits for it) and launches
        # the per-step agreements, so that the training thread hands nothing to the OS in the common case
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-save") if async_save else None
        self._helper = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-helper")
                                if async_save else None)
        self._stager = HostStager() if async_save else None
        self._pending: Future[Any] | None = None
        self._staged: Future[Any] | None = None
        self._check: tuple[torch.Tensor, Future[Any] | None, BaseException | None] | None = None
        self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-delete")
        self._pending_step: int | None = None
        self._best_pending: int | None = None
        self.last_saved_step: int | None = None
        #: steps retention keeps whatever keep_last says (see :meth:`protect_newest`)
        self.protected: set[int] = set()
        if self.rank == 0:
            self._recover_folder()
        if self.distributed:
            dist.barrier(group=self._group)

    # -- saving ---------------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any], *, stage_later: Collection[str] = (),
             best: bool = False) -> None:
        """Save ``state`` as ``step_{step}`` (all ranks call).

        ``best``: once committed, ``best`` names this checkpoint and retention keeps it until another one is
        saved as best (``checkpoint.keep_best``).

        Async mode returns once tensors are staged to host memory, except the tensors of the entries named
        in ``stage_later``: those are copied on the background thread, and the caller must call
        :meth:`fence` before it next changes any of them in place (a trainer: before the optimizer step, as
        forward and backward only read parameters and optimizer state). Synchronous mode ignores it.
        """
        self.wait()
        if best:
            self._best_pending = step
        prepared = self._checkpointer.prepare(state, step)
        if self._executor is None:
            self._write(prepared, self._group)
            return
        later = {k: t for k, t in prepared.tensors.items() if k.split(".", 1)[0] in stage_later}
        now = {k: t for k, t in prepared.tensors.items() if k not in later}
        assert self._stager is not None
        prepared.tensors = self._stager.stage(now)
        assert self._helper is not None
        self._staged = self._helper.submit(self._stager.stage, later)
        self._pending_step = step
        self._pending = self._executor.submit(self._write_staged, prepared, self._staged)

    def protect_newest(self) -> int | None:
        """Keep the newest checkpoint saved so far (in flight, or on disk, e.g. the one resumed from) from
        retention for the rest of this manager's life; a trainer calls it when training starts to go wrong,
        so that the checkpoints of a diverging model cannot push the last good one out. Returns its step."""
        step = self._pending_step if self._pending_step is not None else self.last_saved_step
        if step is None:
            found = step_dirs(self.folder)
            step = found[0][0] if found else None
        if step is not None:
            self.protected.add(step)
        return step

    def _write_staged(self, prepared: Prepared, staged: Future[dict[str, torch.Tensor]]) -> None:
        failed: BaseException | None = None
        try:
            prepared.tensors.update(staged.result())
        except Exception as exc:  # noqa: BLE001 - the write protocol tells every rank, then raises
            failed = exc
        self._write(prepared, self._bg_group, failed=failed)

    def fence(self) -> None:
        """Block until the in-flight save holds its own host copy of every tensor (they may change after)."""
        staged, self._staged = self._staged, None
        if staged is not None:
            wait_futures([staged])  # a staging failure is raised by the write, on every rank

    def _write(self, prepared: Prepared, group: Any, failed: BaseException | None = None) -> None:
        self._checkpointer.write(prepared, self.folder / f"step_{prepared.step}", group=group,
                                 on_commit=self._on_commit, failed=failed)
        self.last_saved_step = prepared.step

    def _on_commit(self, path: Path, manifest: Manifest) -> None:
        """Rank 0, right after ``path`` was committed: move ``latest`` and apply retention."""
        atomic_write(self.folder / LATEST_FILE, f"{path.name}\n".encode())
        if self._best_pending == manifest.step:
            atomic_write(self.folder / BEST_FILE, f"{path.name}\n".encode())
        best = read_pointer(self.folder, BEST_FILE)
        protect = (manifest.step,) + ((int(best[len("step_"):]),) if best and _STEP_RE.match(best) else ())
        protect += tuple(self.protected)
        steps = [s for s, _ in step_dirs(self.folder)]
        for step in to_delete(steps, keep_last=self.keep_last, keep_every=self.keep_every, protect=protect):
            victim = self.folder / f"step_{step}"
            doomed = victim.with_name(victim.name + ".deleting")
            try:
                os.replace(victim, doomed)  # no longer looks like a checkpoint, even if rmtree is cut short
            except OSError as exc:
                log.warning("could not delete old checkpoint %s: %s", victim, exc)
                continue
            # Unlinking a large checkpoint takes a while (freeing its page-cache pages); off the save's path.
            self._janitor.submit(shutil.rmtree, doomed, ignore_errors=True)

    def _raise_failed(self, local_error: BaseException | None) -> None:
        """Every rank (after agreeing that some rank failed): raise naming the failing rank(s) and errors."""
        step = self._pending_step
        self._pending, self._pending_step = None, None
        mine = f"{type(local_error).__name__}: {local_error}" if local_error is not None else None
        errors: list[Any] = [mine]
        if self.distributed:
            errors = [None] * self.world_size
            dist.all_gather_object(errors, mine, group=self._group)
        where = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None) or "unknown error"
        raise CheckpointError(f"background save of step {step} failed ({where}); the previous checkpoint is "
                              "still valid") from local_error

    def start_check(self) -> None:
        """Begin, without blocking, the agreement that the next :meth:`check_background` finishes.

        A trainer calls it at the end of a step; the agreement (a tiny all-reduce) then completes while the
        next step computes, and ``check_background`` finds the answer ready instead of waiting for it.
        """
        if self._pending is None or self._check is not None:
            return
        done = self._pending.done()
        error = self._pending.exception() if done else None
        flags = torch.tensor([1 if error is not None else 0, 0 if done else 1], dtype=torch.int32)
        launched: Future[Any] | None = None
        if self.distributed:
            assert self._helper is not None
            launched = self._helper.submit(dist.all_reduce, flags, op=dist.ReduceOp.MAX, group=self._group,
                                           async_op=True)
        self._check = (flags, launched, error)

    def check_background(self) -> bool:
        """Raise on every rank if the in-flight save failed; a collective while a save is pending.

        Finishes the agreement begun by :meth:`start_check` (or runs one now). Returns whether a save is
        still in flight on some rank (the same answer on every rank).
        """
        if self._pending is None:
            return False
        if self._check is None:
            self.start_check()
        assert self._check is not None
        (flags, launched, error), self._check = self._check, None
        if launched is not None:
            work = launched.result()
            if not work.is_completed():  # usually it is: the call would only cost a hand-off to the OS
                work.wait()
        if flags[0]:
            self._raise_failed(error)
        if not flags[1]:
            self._pending, self._pending_step = None, None
        return bool(flags[1])

    def wait(self) -> None:
        """Block until the in-flight save is committed; raise on every rank if it failed on any."""
        if self._pending is not None and self._check is not None:
            self.check_background()  # finish the agreement in flight first (every rank has one)
        if self._pending is None:
            return
        wait_futures([self._pending])
        self.check_background()  # done on every rank now: clears the save, or raises on every rank if it failed

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    # -- finding and loading --------------------------------------------------------------------------
    def latest(self) -> CheckpointInfo | None:
        """The newest checkpoint that verifies (corrupt or incomplete ones are skipped with a warning)."""
        pointer = read_latest_pointer(self.folder)
        info = find_latest(self.folder)
        if info is not None and pointer is not None and pointer != info.name:
            log.info("latest pointer names %s; newest valid checkpoint is %s", pointer, info.name)
        return info

    def checkpoints(self) -> list[CheckpointInfo]:
        return [CheckpointInfo(step=s, path=p) for s, p in step_dirs(self.folder)]

    def load(self, info_or_path: CheckpointInfo | str | os.PathLike[str], state: Mapping[str, Any]) -> int:
        """Load a checkpoint into ``state`` (all ranks call); return its step.

        A path may name a ``step_N`` folder or a folder of them (then its newest valid one is used).
        """
        from crosstrain.checkpoint.resolve import CHECKPOINT, resolve_path  # it builds on this module

        self.wait()
        info = info_or_path if isinstance(info_or_path, CheckpointInfo) else \
            resolve_path(info_or_path, accept=CHECKPOINT).info
        if not info.verified:
            self._verify_together(info.path)
        return self._checkpointer.load_into(info.path, state, group=self._group)

    def latest_together(self) -> CheckpointInfo | None:
        """:meth:`latest` as a collective (all ranks call): the ranks split each candidate's SHA-256 work
        instead of every rank hashing every file, and agree on the answer. Waits for an in-flight save first."""
        self.wait()  # it may become the newest checkpoint, and its agreement uses the same process group
        if not self.distributed:
            return self.latest()
        candidates: list[Any] = [step_dirs(self.folder) if self.rank == 0 else None]
        dist.broadcast_object_list(candidates, src=0, group=self._group)
        return first_valid(candidates[0], self._problems_together)

    def _problems_together(self, path: Path) -> list[str]:
        """Verify ``path`` with the ranks splitting the SHA-256 work; every rank gets every rank's findings."""
        report = verify(path, shard=(self.rank, self.world_size) if self.distributed else None)
        problems: list[Any] = [report.problems]
        if self.distributed:
            problems = [None] * self.world_size
            dist.all_gather_object(problems, report.problems, group=self._group)
        return sorted({p for part in problems for p in part})

    def _verify_together(self, path: Path) -> None:
        """Verify ``path`` with the ranks splitting the SHA-256 work; raise on every rank if any found a problem."""
        found = self._problems_together(path)
        if found:
            raise CheckpointError(f"checkpoint {path} is not valid: {'; '.join(found)}")

    def close(self) -> None:
        """Wait for the in-flight save (raising if it failed) and release threads and buffers."""
        try:
            self.wait()
        finally:
            for executor in (self._executor, self._helper):
                if executor is not None:
                    executor.shutdown(wait=True)
            self._executor = self._helper = None
            if self._stager is not None:
                self._stager.release()
            self._janitor.shutdown(wait=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- housekeeping ---------------------------------------------------------------------------------
    def _recover_folder(self) -> None:
        """Rank 0 at start-up: restore a ``step_N`` moved aside by an interrupted re-commit, drop leftovers."""
        for child in list(self.folder.iterdir()):
            name = child.name
            if name.endswith(".old") and _STEP_RE.match(name[:-4]) and child.is_dir():
                final = child.with_name(name[:-4])
                if not final.exists():
                    os.replace(child, final)
                else:
                    shutil.rmtree(child, ignore_errors=True)
            elif (name.endswith(".tmp") or name.endswith(".deleting")) and name.startswith("step_"):
                shutil.rmtree(child, ignore_errors=True)
            elif is_temp(name) and child.is_file():
                child.unlink(missing_ok=True)  # a pointer rewrite cut short: the pointer itself is intact

