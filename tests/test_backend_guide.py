"""The README's "Writing a backend plugin" works as written: its code, taken verbatim from README.md and installed as a
package, passes the conformance suite and trains, as a device whose tensors live in host memory."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the two lines the README says a host-memory device changes, and what it changes them to
HOST_MEMORY = {'type = "mychip"': 'type = "cpu"', 'dist_backend = "mychip-ccl"': 'dist_backend = "gloo"'}


def template() -> tuple[str, str]:
    """(pyproject.toml, plugin.py) exactly as the README's section shows them."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Writing a backend plugin", 1)[1].split("\n## ", 1)[0]
    toml = re.findall(r"```toml\n(.*?)```", section, re.S)
    python = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(toml) == 1 and len(python) == 1, "the section has one pyproject.toml and one plugin.py"
    return toml[0], python[0]


def _for_host_memory(code: str) -> str:
    for line, replacement in HOST_MEMORY.items():
        assert code.count(line) == 1, f"the template must have exactly one {line!r}"
        code = code.replace(line, replacement)
    return code


def test_verbatim_template_reports_a_missing_device_in_one_line(tmp_path) -> None:
    _, plugin = template()
    (tmp_path / "plugin.py").write_text(plugin)
    spec = importlib.util.spec_from_file_location("readme_mychip_plugin", tmp_path / "plugin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (backend,) = module.crosstrain_register_backends()
    avail = backend.availability()
    assert not avail and avail.reason == "torch has no torch.mychip module; install the package that adds it"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pyproject, plugin = template()
    pkg = tmp_path_factory.mktemp("crosstrain-mychip")
    (pkg / "pyproject.toml").write_text(pyproject)
    (pkg / "crosstrain_mychip").mkdir()
    (pkg / "crosstrain_mychip" / "__init__.py").write_text("")
    (pkg / "crosstrain_mychip" / "plugin.py").write_text(_for_host_memory(plugin))
    target = pkg.parent / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(pkg)], check=True, capture_output=True, timeout=300)
    return target


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_installed_template_passes_the_conformance_suite(installed) -> None:
    proc = subprocess.run([sys.executable, "-m", "crosstrain.testing.conformance", "--backend", "mychip", "--require",
                           "-q", "-p", "no:cacheprovider"], env=_env(installed), capture_output=True, text=True,
                          timeout=600, cwd=installed)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_installed_template_trains_and_lists_its_kernel(installed, tmp_path) -> None:
    env = _env(installed)
    kernels = subprocess.run([sys.executable, "-m", "crosstrain", "kernels", "--json"], env=env, capture_output=True,
                             text=True, timeout=120)
    ops = {op["op"]: op for op in json.loads(kernels.stdout)["ops"]}
    assert ops["rms_norm"]["signature"] == "rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-06) -> Tensor"
    assert {"backend": "mychip", "device_type": "cpu", "priority": 10, "label": "my_rms_norm"} in \
        ops["rms_norm"]["implementations"]
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "crosstrain", "train", "--set", "backend=mychip", "--set",
                           "train.steps=3", "--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set",
                           "logging.progress=none", "--run-dir", str(run_dir)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["backend"] == "mychip" and summary["steps"] == 3
    assert summary["final_loss"] < summary["initial_loss"] and summary["peak_flops"]["flops"] == 100e12


def test_docs_list_every_kernel_signature() -> None:
    from crosstrain.kernels import registry

    docs = (ROOT / "docs" / "native_kernels.md").read_text()
    listed = dict(re.findall(r"^- `(\w+)(\(.*\) -> .*)`: ", docs, re.M))
    assert listed == {name: spec.signature for name, spec in registry.ops().items()}
