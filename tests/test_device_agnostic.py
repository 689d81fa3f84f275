"""The core and the plugins never name a device API, a collective backend, or a backend module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = re.compile(r"torch\.cuda|\.cuda\(|torch_npu|torch\.npu|[\"'](nccl|hccl|rccl)[\"']")


def _sources() -> list[Path]:
    return sorted(p for d in ("core", "plugins") for p in (ROOT / d).rglob("*.py"))


def test_no_device_specific_names():
    hits = []
    for path in _sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "device-specific code in core/ or plugins/:\n" + "\n".join(hits)


def test_no_backend_imports():
    hits = []
    for path in _sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith("crosstrain.backends"):
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}")
    assert not hits, "core/ or plugins/ import a backend:\n" + "\n".join(hits)


def test_checker_catches_a_violation(tmp_path):
    assert FORBIDDEN.search("x = torch.cuda.current_device()")
    assert FORBIDDEN.search("dist.init_process_group('nccl')")
    assert not FORBIDDEN.search("backend = device.dist_backend")
