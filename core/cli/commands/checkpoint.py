"""``crosstrain checkpoint verify|consolidate|ls``: inspect and export checkpoints."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from crosstrain.errors import CheckpointError


def _verify(args: argparse.Namespace) -> int:
    from crosstrain.checkpoint.manager import looks_like_step_dir, step_dirs
    from crosstrain.checkpoint.verify import verify

    path = Path(args.path)
    targets = [path]
    if not (path / "manifest.json").exists():
        found = step_dirs(path) or step_dirs(path / "checkpoints")
        if found:
            targets = [p for _, p in found]
        elif not path.exists():
            raise CheckpointError(f"no checkpoint at {path}; pass a step_N folder or a checkpoints folder")
        elif path.is_dir() and not looks_like_step_dir(path):  # a run dir or checkpoints folder holding none
            raise CheckpointError(f"{path} holds no checkpoints (a run saves one at its end unless "
                                  "checkpoint.final=false, and every checkpoint.every steps)")
    reports = [verify(p, checksums=not args.quick) for p in targets]
    if args.json:
        print(json.dumps([r.as_dict() for r in reports], indent=1))
    else:
        for r in reports:
            status = "ok" if r.ok else "BAD"
            print(f"{status:4} {r.path}  step={r.step} files={r.files} bytes={r.bytes}"
                  + ("" if r.ok else f"  ({r.reason})"))
    return 0 if all(r.ok for r in reports) else 1


def _consolidate(args: argparse.Namespace) -> int:
    from crosstrain.checkpoint.consolidate import consolidate

    stats = consolidate(args.path, args.out)
    print(f"wrote {args.out}: {stats['tensors']} tensors, {stats['bytes']} bytes")
    return 0


def _ls(args: argparse.Namespace) -> int:
    from crosstrain.checkpoint.manager import read_latest_pointer, step_dirs
    from crosstrain.checkpoint.verify import verify

    root = Path(args.run_dir)
    folder = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    if not folder.is_dir():
        raise CheckpointError(f"{root} is not a run directory or checkpoints folder")
    pointer = read_latest_pointer(folder)
    rows: list[dict[str, Any]] = []
    for step, path in step_dirs(folder):
        report = verify(path, checksums=args.check)
        rows.append({"step": step, "path": str(path), "bytes": report.bytes, "ok": report.ok,
                     "verified": bool(args.check), "latest": path.name == pointer, "problems": report.problems})
    # without --check only presence and sizes were checked: never call that "ok"
    code = 0 if all(r["ok"] for r in rows) else 1
    if args.json:
        print(json.dumps(rows, indent=1))
        return code
    if not rows:
        print(f"no checkpoints in {folder}")
        return 0
    for r in rows:
        mark = "*" if r["latest"] else " "
        state = ("ok" if args.check else "unverified (sizes ok; --check reads the checksums)") if r["ok"] \
            else "BAD: " + "; ".join(r["problems"])
        print(f"{mark} step_{r['step']:<8} {r['bytes'] / 2**20:10.1f} MiB  {state}")
    return code


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="verify, consolidate and list checkpoints")
    csub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    v = csub.add_parser("verify", help="check completeness and SHA-256 checksums")
    v.add_argument("path", help="a step_N folder, or a folder of them")
    v.add_argument("--quick", action="store_true", help="check presence and sizes only")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=_verify)
    c = csub.add_parser("consolidate", help="write the full model weights to one safetensors file")
    c.add_argument("path", help="a step_N folder, or a folder of them (newest valid is used)")
    c.add_argument("--out", required=True, help="output .safetensors file")
    c.set_defaults(func=_consolidate)
    ls = csub.add_parser("ls", help="list a run's checkpoints")
    ls.add_argument("run_dir", help="runs/<timestamp> or its checkpoints folder")
    ls.add_argument("--check", action="store_true", help="also verify checksums (reads every file)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_ls)
