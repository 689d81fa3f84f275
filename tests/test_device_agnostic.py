"""The core and the plugins never name a device API, a collective backend, a device's environment variable,
or a backend module. Backends own those names (doctor lines, visibility variables, build flags)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = re.compile(
    r"torch\.cuda|\.cuda\(|torch_npu|torch-npu|torch\.npu|[\"'](nccl|hccl|rccl)[\"']"
    r"|torch\.version\.(cuda|hip)|version\.__dict__"  # which GPU toolkit torch was built with
    r"|\b(CUDA|HIP|ROCR|ASCEND_RT|ZE)_VISIBLE_DEVICES\b|\bZE_AFFINITY_MASK\b"  # device visibility variables
    r"|[A-Z_]*(NCCL|RCCL|HCCL|ASCEND|TRITON)_[A-Z_]+"  # the vendors' and Triton's environment variables
)


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
    for env in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TRITON_INTERPRET"):
        assert FORBIDDEN.search(f'os.environ.get("{env}")'), env
    assert FORBIDDEN.search('{"cuda": torch.version.__dict__.get("cuda")}')
    assert not FORBIDDEN.search('ENV_VARS = ("CROSSTRAIN_BACKEND", "WORLD_SIZE", "OMP_NUM_THREADS")')
