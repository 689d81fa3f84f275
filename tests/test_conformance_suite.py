"""The shipped conformance suite, run exactly as a backend author would run it."""

from __future__ import annotations

import subprocess
import sys


def run_suite(backend: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                           "crosstrain.testing.conformance", "--backend", backend],
                          capture_output=True, text=True, timeout=600)


def test_conformance_passes_on_cpu():
    proc = run_suite("cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_unavailable_backend_skips_with_reason_never_passes():
    proc = run_suite("npu")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "passed" not in proc.stdout.splitlines()[-1]
    assert "skipped" in proc.stdout.splitlines()[-1]
    assert "backend 'npu' unavailable here" in proc.stdout + proc.stderr


def test_conformance_passes_on_simdev_with_require():
    # simdev: the software device whose memory the host cannot read (backends/simdev), not hardware
    proc = subprocess.run([sys.executable, "-m", "crosstrain.testing.conformance", "--backend", "simdev", "--require",
                           "-q", "-p", "no:cacheprovider"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and "failed" not in last
