"""The foundation CLI commands, run as a user would (real subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from crosstrain import registry


def crosstrain(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "crosstrain", *args], capture_output=True, text=True, timeout=120,
                          env=None if env is None else {**os.environ, **env})


def test_backends_json_agrees_with_each_backends_probe():
    """Holds on any host: the CLI reports what each backend's own probe says here, and every "no" has a reason."""
    proc = crosstrain("backends", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    by_name = {b["name"]: b for b in data["backends"]}
    assert by_name["cpu"]["available"] is True and by_name["cpu"]["dist_backend"] == "gloo"
    for name in ("cuda", "rocm", "npu"):
        assert name in by_name, f"{name} backend not discovered: {data['plugin_errors']}"
        probe = registry.get_backend(name).availability()
        assert by_name[name]["available"] is probe.available, (name, by_name[name], probe)
        if not probe.available:
            assert by_name[name]["reason"] == probe.reason and probe.reason, f"{name} unavailable without a reason"
    assert not (by_name["cuda"]["available"] and by_name["rocm"]["available"]), "a torch build is CUDA or ROCm"
    assert data["plugin_errors"] == []


def test_backends_table_and_kernels_and_doctor():
    proc = crosstrain("backends")
    assert proc.returncode == 0 and "cpu" in proc.stdout
    kernels = json.loads(crosstrain("kernels", "--json").stdout)
    assert {"rms_norm", "rotary_embedding", "swiglu", "cross_entropy"} <= {o["op"] for o in kernels["ops"]}
    doctor = json.loads(crosstrain("doctor", "--json").stdout)
    assert doctor["packages"]["torch"] and doctor["backends"]["cpu"]["available"] is True


def test_doctor_lines_come_from_each_backend():
    env = {"CUDA_VISIBLE_DEVICES": "3", "HIP_VISIBLE_DEVICES": "1", "ASCEND_RT_VISIBLE_DEVICES": "0,1"}
    proc = crosstrain("doctor", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    backends = json.loads(proc.stdout)["backends"]
    assert backends["cuda"]["details"]["CUDA_VISIBLE_DEVICES"] == "3" and "triton" in backends["cuda"]["details"]
    assert backends["rocm"]["details"]["HIP_VISIBLE_DEVICES"] == "1"
    assert backends["npu"]["details"]["ASCEND_RT_VISIBLE_DEVICES"] == "0,1"
    assert "torch-npu" in backends["npu"]["details"]
    assert "native CPU optimizer" in backends["cpu"]["details"]
    text = crosstrain("doctor", env=env).stdout
    assert "CUDA_VISIBLE_DEVICES: 3" in text


def test_unknown_backend_is_one_line_error(monkeypatch):
    proc = subprocess.run([sys.executable, "-c", "from crosstrain import registry; registry.select_backend()"],
                          capture_output=True, text=True, env={"CROSSTRAIN_BACKEND": "warpdrive", "PATH": ""},
                          timeout=60)
    assert proc.returncode != 0 and "unknown backend 'warpdrive'" in proc.stderr
