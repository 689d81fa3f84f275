"""DCP storage that never executes pickled code on load, and hashes every file as it is written.

DCP's ``FileSystemWriter`` stores tensors with ``torch.save`` (read back with ``weights_only=True``) and
its ``.metadata`` file with plain :mod:`pickle`; non-tensor (``BYTE_IO``) items are read back with
``torch.load(weights_only=False)``. :class:`SafeFileSystemReader` closes both holes: it reads ``.metadata``
through :class:`MetadataUnpickler`, which resolves only DCP's own metadata classes, torch dtypes/layouts
and ``torch.Size``, and it refuses ``BYTE_IO`` items outright (crosstrain keeps non-tensor state in JSON).

:class:`HashingFileSystemWriter` is DCP's writer with a file system that computes each file's SHA-256
while the bytes are written (each piece hashed while it is still in cache) and flushes Python's buffer
before DCP's ``fsync``, so the manifest costs no second read of the checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from crosstrain.errors import CheckpointError

METADATA_FILE = ".metadata"

_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {}


def _allowed() -> dict[tuple[str, str], Any]:
    if not _ALLOWED_GLOBALS:
        from pathlib import PurePosixPath

        from torch.distributed.checkpoint import filesystem as fs_mod
        from torch.distributed.checkpoint import metadata as md_mod
        from torch.serialization import _get_layout

        for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                     "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"):
            _ALLOWED_GLOBALS[("torch.distributed.checkpoint.metadata", name)] = getattr(md_mod, name)
        _ALLOWED_GLOBALS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = fs_mod._StorageInfo
        _ALLOWED_GLOBALS[("torch.serialization", "_get_layout")] = _get_layout
        _ALLOWED_GLOBALS[("torch", "Size")] = torch.Size
        for module in ("pathlib", "pathlib._local"):
            _ALLOWED_GLOBALS[(module, "PosixPath")] = PurePosixPath
            _ALLOWED_GLOBALS[(module, "PurePosixPath")] = PurePosixPath
    return _ALLOWED_GLOBALS


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: any global outside a fixed allow-list raises :class:`CheckpointError`."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed()
        if (module, name) in allowed:
            return allowed[(module, name)]
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise CheckpointError(f"refusing to load {module}.{name} from checkpoint metadata (not DCP metadata)")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError("refusing persistent ids in checkpoint metadata")


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """Read a DCP ``.metadata`` file without executing pickled code."""
    file = Path(path) / METADATA_FILE if Path(path).is_dir() else Path(path)
    try:
        with open(file, "rb") as fh:
            metadata = MetadataUnpickler(fh).load()
    except CheckpointError as exc:
        raise CheckpointError(f"{file}: {exc}") from None
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing; the checkpoint is incomplete") from None
    except Exception as exc:
        raise CheckpointError(f"{file} is not valid DCP metadata: {type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} is not DCP metadata (got {type(metadata).__name__})")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata read is restricted and which refuses pickled (BYTE_IO) items."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_metadata(self.path)
        storage_meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointError(
                    f"checkpoint entry {item.dest_index.fqn!r} is a pickled object; crosstrain refuses to unpickle"
                )
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except Exception as exc:  # torch.load(weights_only=True) rejecting a tampered file, short reads, ...
            raise CheckpointError(f"cannot read checkpoint data under {self.path}: {type(exc).__name__}: {exc}") \
                from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """Default planner that refuses to unpickle ``BYTE_IO`` items (second line of defence)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is pickled; refusing to load it")


def call_dcp(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a DCP entry point; turn its ``CheckpointException`` (a BaseException) into :class:`CheckpointError`."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return fn(*args, **kwargs)
    except CheckpointException as exc:
        for _rank, (err, _trace) in sorted(exc.failures.items()):
            if isinstance(err, CheckpointError):
                raise CheckpointError(str(err)) from None
        rank, (err, _trace) = sorted(exc.failures.items())[0]
        first = str(err).splitlines()[0] if str(err) else ""
        failure = CheckpointError(f"{what} failed on rank {rank}: {type(err).__name__}: {first}")
        failure.rank, failure.detail = rank, f"{type(err).__name__}: {first}"  # type: ignore[attr-defined]
        raise failure from None


# -- writing -------------------------------------------------------------------------------------------

#: SHA-256 reads a piece that was just written from cache: ~1.7x faster than from memory on the machines
#: measured (docs/checkpointing.md).
HASH_PIECE_BYTES = 512 << 10
_WRITEBACK_BYTES = 16 << 20


def _writeback_starter() -> Any:
    """``start(fd, offset, nbytes)``: ask the kernel to begin writing a range back now, without waiting
    (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``); None where unavailable. Without it the disk only starts
    at fsync time on a machine with lots of RAM, so hashing and disk writes would not overlap."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    except (OSError, AttributeError):
        return None
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, 2)


start_writeback = _writeback_starter()


class HashingFile(io.RawIOBase):
    """A binary file that feeds every written byte to SHA-256 (each piece right after it is written)."""

    def __init__(self, path: Path, on_close: Any) -> None:
        super().__init__()
        self._fh = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._hash = hashlib.sha256()
        self._on_close = on_close
        self._size = 0
        self._written_back = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        # hash each piece right after writing it, while the page-cache copy has left it in this core's cache
        for start in range(0, view.nbytes, HASH_PIECE_BYTES):
            piece = view[start:start + HASH_PIECE_BYTES]
            self._fh.write(piece)
            self._hash.update(piece)
        self._size += view.nbytes
        if start_writeback is not None and self._size - self._written_back >= _WRITEBACK_BYTES:
            self._fh.flush()
            start_writeback(self._fh.fileno(), self._written_back, self._size - self._written_back)
            self._written_back = self._size
        return view.nbytes

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        if not self._fh.closed:
            self._fh.flush()

    def fileno(self) -> int:
        self._fh.flush()  # DCP calls os.fsync(stream.fileno()): make sure Python's buffer is in the OS first
        return self._fh.fileno()

    def close(self) -> None:
        if not self.closed:
            self._fh.close()
            self._on_close(self._hash.hexdigest(), self._size)
        super().close()


class HashingFileSystem(FileSystem):
    """DCP ``FileSystem`` recording ``{file name: (sha256, bytes)}`` for every file written."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)

        def record(digest: str, size: int) -> None:
            with self._lock:
                self.digests[path.name] = (digest, size)

        stream = HashingFile(path, record)
        try:
            yield stream
        finally:
            stream.close()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.digests:
                self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)



_crc_lock = threading.Lock()
_crc_users = 0


@contextmanager
def without_zip_crc32() -> Generator[None, None, None]:
    """Skip torch.save's per-record CRC32 while our writer runs: every file gets a SHA-256 in the manifest
    anyway, and the CRC pass costs as much CPU as the write itself. (torch.load ignores the missing CRCs.)"""
    global _crc_users
    with _crc_lock:
        if _crc_users == 0:
            torch.serialization.set_crc32_options(False)
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                torch.serialization.set_crc32_options(True)


class HashingFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (fsync on, one file per rank and thread) that records file hashes."""

    def __init__(self, path: str | os.PathLike[str], *, thread_count: int = 1) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=thread_count,
                         overwrite=True)
        self.fs: HashingFileSystem = HashingFileSystem()

    @property
    def digests(self) -> dict[str, tuple[str, int]]:
        return dict(self.fs.digests)
