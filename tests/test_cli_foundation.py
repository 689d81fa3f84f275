"""The foundation CLI commands, run as a user would (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys


def crosstrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "crosstrain", *args], capture_output=True, text=True, timeout=120)


def test_backends_json_lists_cpu_available_and_accelerators_with_reasons():
    proc = crosstrain("backends", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    by_name = {b["name"]: b for b in data["backends"]}
    assert by_name["cpu"]["available"] is True and by_name["cpu"]["dist_backend"] == "gloo"
    for name in ("cuda", "rocm", "npu"):
        assert name in by_name, f"{name} backend not discovered: {data['plugin_errors']}"
        assert by_name[name]["available"] is False
        assert by_name[name]["reason"], f"{name} unavailable without a reason"
    assert data["plugin_errors"] == []


def test_backends_table_and_kernels_and_doctor():
    proc = crosstrain("backends")
    assert proc.returncode == 0 and "cpu" in proc.stdout
    kernels = json.loads(crosstrain("kernels", "--json").stdout)
    assert {"rms_norm", "rotary_embedding", "swiglu", "cross_entropy"} <= {o["op"] for o in kernels["ops"]}
    doctor = json.loads(crosstrain("doctor", "--json").stdout)
    assert doctor["packages"]["torch"] and doctor["backends"]["cpu"]["available"] is True


def test_unknown_backend_is_one_line_error(monkeypatch):
    proc = subprocess.run([sys.executable, "-c", "from crosstrain import registry; registry.select_backend()"],
                          capture_output=True, text=True, env={"CROSSTRAIN_BACKEND": "warpdrive", "PATH": ""},
                          timeout=60)
    assert proc.returncode != 0 and "unknown backend 'warpdrive'" in proc.stderr
