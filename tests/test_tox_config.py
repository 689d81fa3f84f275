"""tox.ini stays valid, and its hardware envs are gated by toxfile.py before they install anything."""

from __future__ import annotations

import configparser
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARDWARE_ENVS = {"cuda": "nvidia", "rocm": "amd", "npu": "ascend"}

pytest.importorskip("tox", reason="tox is in the dev extra")


def _toxfile():
    spec = importlib.util.spec_from_file_location("crosstrain_toxfile", ROOT / "toxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_env_configuration_is_valid():
    """What CI checks too: tox evaluates every setting of every env and exits non-zero on a bad one."""
    proc = subprocess.run([sys.executable, "-m", "tox", "config", "-e", "ALL"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "Exception" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_hardware_envs_are_gated_and_require_their_backend():
    ini = configparser.ConfigParser(interpolation=None)
    ini.read(ROOT / "tox.ini")
    probes = _toxfile().PROBES
    for env, hardware in HARDWARE_ENVS.items():
        section = ini[f"testenv:{env}"]
        assert section["hardware"] == hardware and hardware in probes
        # where the hardware is there, an unusable backend must fail, not skip
        assert f"crosstrain.testing.conformance --backend {env} --require" in section["commands"]


def test_probe_reports_absent_hardware_and_sees_a_node_or_a_tool(monkeypatch):
    toxfile = _toxfile()
    monkeypatch.setattr(toxfile.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(toxfile.shutil, "which", lambda tool: None)
    for kind in HARDWARE_ENVS.values():
        assert "driver here" in toxfile.missing_hardware(kind)
    monkeypatch.setattr(toxfile.glob, "glob", lambda pattern: ["/dev/kfd"] if pattern == "/dev/kfd" else [])
    assert toxfile.missing_hardware("amd") is None and toxfile.missing_hardware("nvidia")
    monkeypatch.setattr(toxfile.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(toxfile.shutil, "which", lambda tool: "/usr/bin/nvidia-smi" if tool == "nvidia-smi" else None)
    assert toxfile.missing_hardware("nvidia") is None


@pytest.mark.skipif(_toxfile().missing_hardware("ascend") is None, reason="this machine has an Ascend driver")
def test_absent_hardware_env_skips_with_one_line_and_exit_0():
    proc = subprocess.run([sys.executable, "-m", "tox", "-e", "npu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "skipped" in line]
    assert len(lines) == 1 and lines[0].startswith("npu: skipped: no Ascend NPU driver here"), proc.stdout
    assert "install_deps" not in proc.stdout and "commands[" not in proc.stdout, proc.stdout


def test_type_env_installs_every_dependency_mypy_reads_without_building_the_package():
    """The type env skips the package build (mypy reads core/ from the tree) but installs each of the package's
    dependencies, so mypy checks core/ against their types exactly as with the package installed."""
    from crosstrain.config.toml_io import read_toml

    ini = configparser.ConfigParser(interpolation=None)
    ini.read(ROOT / "tox.ini")
    section = ini["testenv:type"]
    assert section.getboolean("skip_install") and section["commands"].strip().startswith("mypy core")
    deps = {line.strip() for line in section["deps"].splitlines() if line.strip()}
    assert "-r requirements/cpu.txt" in deps and {"mypy>=1.10", "pytest>=8"} <= deps  # the torch pin
    wanted = [d for d in read_toml(ROOT / "pyproject.toml")["project"]["dependencies"] if not d.startswith("torch")]
    assert wanted and set(wanted) <= deps, sorted(set(wanted) - deps)
