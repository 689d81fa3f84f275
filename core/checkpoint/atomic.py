"""Writing a file whole or not at all, and a full disk reported as one line by every writer.

:func:`atomic_path` (for libraries that write to a path: safetensors, numpy, ONNX, tokenizers) and
:func:`atomic_write` (bytes or text) write to a temp file beside the target, fsync it, rename it over the target
and fsync the folder, so a reader sees the old file or the new one, never half of one (POSIX ``rename``). When
the write fails the temp file is removed and the previous version stays; a write that ran out of room (ENOSPC,
EDQUOT, EFBIG under ``ulimit -f``, in whatever form the library reports it) raises
:class:`~crosstrain.checkpoint.space.NoSpaceError` naming the path, the free space and the fix.
:func:`disk_errors` gives the same error to writers that append (metrics.jsonl) or fill a temp folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from crosstrain.checkpoint import space


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a folder, so a rename or a new file in it survives a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """The temp file :func:`atomic_path` writes: hidden, per process, with the target's suffix kept (numpy,
    ONNX and torch choose the format from it)."""
    return path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")


def is_temp(name: str) -> bool:
    """Whether a file name is one :func:`temp_path` makes (left behind only by a process that was killed)."""
    stem = name.rsplit(".tmp", 1)
    return name.startswith(".") and len(stem) == 2 and stem[0].rsplit(".", 1)[-1].isdigit()


def _out_of_room(exc: BaseException, path: Path, written: Path | None) -> bool:
    """Whether ``exc`` (or what caused it) failed for want of room. A library may hide the errno (torch's zip
    writer says only "file write failed"), so an I/O error on a file system with under 1 MiB left, or once
    ``written`` reached the file-size limit, counts too."""
    if says_no_space(exc):
        return True
    if not isinstance(exc, (OSError, RuntimeError)):  # a ValueError of the caller's is never the disk's
        return False
    free = space.free_bytes(path.parent)
    if free is not None and free < 1 << 20:
        return True
    limit = space.file_size_limit()
    return limit is not None and written is not None and written.is_file() and written.stat().st_size >= limit


def says_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` or an error that caused it says a write ran out of room (errno or text)."""
    seen: BaseException | None = exc
    while seen is not None:
        if space.says_no_space(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextmanager
def disk_errors(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn a failed write under this block that ran out of room (appending to ``path``, or filling a temp folder
    that becomes ``path``) into the one-line ``NoSpaceError`` for ``path``; any other error passes unchanged."""
    try:
        yield
    except space.NoSpaceError:
        raise
    except Exception as exc:
        if _out_of_room(exc, Path(path), None):
            raise space.no_space_for_file(path) from exc
        raise


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temp path to write ``path``'s new content to; on leaving the block it is fsynced and renamed over
    ``path``. On any error the temp file is removed and ``path`` is left as it was; one that ran out of room is
    a ``NoSpaceError`` (stating the free space once the temp file is gone)."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except Exception as exc:
        full = not isinstance(exc, space.NoSpaceError) and _out_of_room(exc, path, tmp)
        _discard(tmp)
        if full:
            raise space.no_space_for_file(path) from exc
        raise
    finally:
        _discard(tmp)


def _discard(tmp: Path) -> None:
    """Remove a temp file; truncated first, since a library may still hold it open (torch's zip writer, until
    its error is collected) and an unlinked open file keeps its room."""
    if tmp.is_file():
        os.truncate(tmp, 0)
        tmp.unlink()


def atomic_write(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) through :func:`atomic_path`."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
