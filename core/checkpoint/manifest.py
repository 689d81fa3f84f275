"""The checkpoint manifest: every file's SHA-256 and size, written last so its presence marks completeness.

``manifest.json`` carries its own checksum (``manifest_sha256`` over the canonical JSON of the other
fields), so a flipped byte in the manifest itself is detected too.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.atomic import fsync_dir
from crosstrain.errors import CheckpointError

MANIFEST_FILE = "manifest.json"
META_FILE = "meta.json"
FORMAT_VERSION = 1
_CHUNK = 512 << 10  # fits a core's L2 cache: SHA-256 reads it from there


def write_durable(path: Path, data: bytes) -> tuple[str, int]:
    """Write ``data`` to ``path`` (no rename: a file of a checkpoint folder that is renamed whole) and fsync it;
    return its (sha256, size)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return hashlib.sha256(data).hexdigest(), len(data)


def sha256_file(path: Path) -> str:
    """SHA-256 of a file, read in cache-sized pieces into one reused buffer (hashed while still in cache)."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        if hasattr(os, "posix_fadvise"):  # read the whole file ahead while we hash (and keep it for the load)
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def read_json_object(path: Path, *, missing: str, kind: str = "a JSON object") -> dict[str, Any]:
    """Read a JSON object from ``path``; any problem is a one-line :class:`CheckpointError`."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {missing}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not {kind}")
    return data


@dataclass
class Manifest:
    """What a committed checkpoint folder holds."""

    step: int
    world_size: int
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"sha256", "bytes"}
    created: float = field(default_factory=time.time)
    format: int = FORMAT_VERSION

    def body(self) -> dict[str, Any]:
        return {"format": self.format, "step": self.step, "world_size": self.world_size,
                "created": self.created, "files": self.files}

    def to_bytes(self) -> bytes:
        body = self.body()
        body["manifest_sha256"] = hashlib.sha256(_canonical(self.body())).hexdigest()
        return json.dumps(body, indent=1, sort_keys=True).encode()

    def write(self, folder: Path) -> None:
        """Write ``manifest.json`` into ``folder`` and fsync it (the caller renames the folder after)."""
        write_durable(folder / MANIFEST_FILE, self.to_bytes())
        fsync_dir(folder)

    @property
    def total_bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.files.values())

    @classmethod
    def read(cls, folder: str | os.PathLike[str]) -> Manifest:
        """Parse and self-check ``folder/manifest.json``; raise :class:`CheckpointError` naming the problem."""
        path = Path(folder) / MANIFEST_FILE
        raw = read_json_object(path, missing="the checkpoint was never committed", kind="a manifest")
        claimed = raw.pop("manifest_sha256", None)
        try:
            manifest = cls(step=int(raw["step"]), world_size=int(raw["world_size"]), files=dict(raw["files"]),
                           created=float(raw["created"]), format=int(raw["format"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path} is malformed: {exc}") from None
        if claimed != hashlib.sha256(_canonical(manifest.body())).hexdigest():
            raise CheckpointError(f"{path} fails its own checksum (corrupt manifest)")
        if manifest.format > FORMAT_VERSION:
            raise CheckpointError(f"{path} has format {manifest.format}; this crosstrain reads up to {FORMAT_VERSION}")
        return manifest
