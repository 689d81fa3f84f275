"""Disk space: a checkpoint's checked before writing, and a full disk reported as such when any write fails.

A full disk surfaces from deep inside a writer in many forms (``OSError: [Errno 28]``, safetensors'
``IoError(... StorageFull ...)``, or torch's zip writer's ``[enforce fail at inline_container.cc] unexpected pos``);
whatever the form, the user reads one line saying so, with the free space and the fix: :func:`no_space` for a
checkpoint (with the size it needs), :func:`no_space_for_file` for every other file (through
:mod:`crosstrain.checkpoint.atomic`).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from crosstrain.errors import CheckpointError

if TYPE_CHECKING:  # torch stays out of light writers (config, tokenizer files)
    import torch

_NO_SPACE_TEXT = ("no space left on device", "disk quota exceeded", "unexpected pos", "file too large")


class NoSpaceError(CheckpointError):
    """A checkpoint or another file does not fit on the file system it is written to (or under ``ulimit -f``)."""


#: what a checkpoint holds besides tensor bytes: per tensor its zip entry, metadata and JSON skeleton (about
#: 2 KiB measured on the tiny GPT), per checkpoint a few small files, each rounded up to a page.
PER_TENSOR_BYTES = 2048
PER_CHECKPOINT_BYTES = 16384


def estimate_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """About the bytes this rank writes for ``tensors`` (a sharded tensor counts its local shard only)."""
    from crosstrain.parallel.local import local_tensor

    total = PER_CHECKPOINT_BYTES + PER_TENSOR_BYTES * len(tensors)
    for t in tensors.values():
        local = local_tensor(t)
        total += local.numel() * local.element_size()
    return total


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing parent); None when unknown."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n < 1e8 else f"{n / 1e6:,.0f} MB"


def file_size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``, RLIMIT_FSIZE), or None when there is none."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def no_space(path: str | os.PathLike[str], needed: int, rank: int | None = None) -> NoSpaceError:
    """The one-line error; ``rank``: the rank whose write failed (multi-process saves)."""
    free = free_bytes(path)
    room = f", {_mb(free)} free" if free is not None else ""
    where = f" (rank {rank})" if rank is not None else ""
    limit = file_size_limit()
    if limit is not None and (free is None or free >= needed):  # the disk has room: the limit stopped the write
        return NoSpaceError(f"a file-size limit (ulimit -f, {_mb(limit)}) stopped a checkpoint write at {path}{where} "
                            f"(needed about {_mb(needed)}{room}); raise it (ulimit -f unlimited); the previous "
                            "checkpoint and 'latest' are still valid")
    return NoSpaceError(f"no space left on device at {path}{where} (needed about {_mb(needed)}{room}); free some "
                        "space or lower checkpoint.keep_last; the previous checkpoint and 'latest' are still valid")


def no_space_for_file(path: str | os.PathLike[str]) -> NoSpaceError:
    """The one-line error for a file (not a checkpoint) whose write ran out of room; the write left ``path`` as
    it was before (the atomic writers replace it only when complete)."""
    path = Path(path)
    free = free_bytes(path.parent)
    room = f" ({_mb(free)} free)" if free is not None else ""
    kept = f"the previous {path.name} is unchanged" if path.exists() else "nothing was written"
    limit = file_size_limit()
    if limit is not None and (free is None or free >= 1 << 20):  # the disk has room: the limit stopped the write
        return NoSpaceError(f"a file-size limit (ulimit -f, {_mb(limit)}) stopped writing {path}{room}; raise it "
                            f"(ulimit -f unlimited); {kept}")
    return NoSpaceError(f"no space left on device writing {path}{room}; free some space there or write to another "
                        f"disk; {kept}")


def check(path: str | os.PathLike[str], needed: int) -> NoSpaceError | None:
    """A :class:`NoSpaceError` when ``needed`` bytes clearly do not fit at ``path``; None when they may."""
    free = free_bytes(path)
    return no_space(path, needed) if free is not None and needed > free else None


def says_no_space(error: BaseException | str) -> bool:
    """Whether an error's errno (ENOSPC, EDQUOT, EFBIG) or text says a write ran out of room."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC),
                                                      errno.EFBIG):
        return True
    return any(text in str(error).lower() for text in _NO_SPACE_TEXT)


def looks_like_no_space(error: BaseException | str, path: str | os.PathLike[str], needed: int) -> bool:
    """Whether a failed write failed for want of space: its errno or text says so, or the disk is now full."""
    if says_no_space(error):
        return True
    free = free_bytes(path)
    return free is not None and free < min(needed, 1 << 20)
