"""Check a committed checkpoint folder: manifest self-checksum, every file present with its size and SHA-256."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.manifest import MANIFEST_FILE, Manifest, sha256_file
from crosstrain.errors import CheckpointError


@dataclass
class VerifyReport:
    """Outcome of :func:`verify`. ``ok`` is true only if every check passed."""

    path: str
    ok: bool
    step: int | None = None
    world_size: int | None = None
    files: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def reason(self) -> str:
        return "; ".join(self.problems) if self.problems else "ok"

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "step": self.step, "world_size": self.world_size,
                "files": self.files, "bytes": self.bytes, "problems": self.problems}

    def raise_if_bad(self) -> None:
        if not self.ok:
            raise CheckpointError(f"checkpoint {self.path} is not valid: {self.reason}")


def verify(path: str | os.PathLike[str], *, checksums: bool = True,
           shard: tuple[int, int] | None = None) -> VerifyReport:
    """Verify the checkpoint folder ``path``. With ``checksums=False`` only presence and sizes are checked.

    ``shard=(i, n)`` hashes only the files that part i of n gets when the files are split into n parts of
    about equal bytes, so n ranks can split the checksum work and combine their reports; presence and sizes
    are always checked for all files.
    """
    folder = Path(path)
    report = VerifyReport(path=str(folder), ok=False)
    if not folder.is_dir():
        report.problems.append("not a directory")
        return report
    try:
        manifest = Manifest.read(folder)
    except CheckpointError as exc:
        report.problems.append(str(exc))
        return report
    report.step, report.world_size = manifest.step, manifest.world_size
    report.files, report.bytes = len(manifest.files), manifest.total_bytes
    owner = _split_by_bytes(manifest.files, shard[1]) if shard is not None else {}
    for name, entry in sorted(manifest.files.items()):
        file = folder / name
        if name == MANIFEST_FILE or Path(name).name != name:
            report.problems.append(f"manifest lists an invalid file name {name!r}")
            continue
        if not file.is_file():
            report.problems.append(f"{name} is missing")
            continue
        size = file.stat().st_size
        if size != int(entry.get("bytes", -1)):
            report.problems.append(f"{name} has {size} bytes, manifest says {entry.get('bytes')}")
            continue
        mine = shard is None or owner.get(name) == shard[0]
        if checksums and mine and sha256_file(file) != entry.get("sha256"):
            report.problems.append(f"{name} fails its SHA-256 check (corrupt)")
    report.ok = not report.problems
    return report


def _split_by_bytes(files: dict[str, dict[str, Any]], parts: int) -> dict[str, int]:
    """Assign each file to one of ``parts`` parts, largest first to the lightest part (same answer everywhere)."""
    load = [0] * parts
    owner: dict[str, int] = {}
    for name, entry in sorted(files.items(), key=lambda kv: (-int(kv[1].get("bytes", 0) or 0), kv[0])):
        part = min(range(parts), key=lambda p: (load[p], p))
        owner[name] = part
        load[part] += int(entry.get("bytes", 0) or 0)
    return owner
