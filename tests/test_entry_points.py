"""Real entry-point discovery in fresh interpreters: a third-party package, and a broken one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, extra_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(extra_path), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_example_third_party_backend_is_discovered_once_installed(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT / "examples" / "crosstrain-xpu")],
                   check=True, capture_output=True, timeout=300)
    code = ("import json, sys; from crosstrain.cli.commands.backends import collect; "
            "json.dump(collect(), sys.stdout)")
    before = json.loads(_run(code, tmp_path / "empty").stdout)
    assert "xpu" not in [b["name"] for b in before["backends"]]
    proc = _run(code, target)
    data = json.loads(proc.stdout)
    xpu = {b["name"]: b for b in data["backends"]}["xpu"]
    assert xpu["available"] is False and xpu["reason"]
    assert xpu["dist_backend"] == "xccl"


def test_broken_plugin_never_breaks_import_or_other_backends(tmp_path):
    dist = tmp_path / "site" / "broken_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[crosstrain]\nbroken = broken_plugin_mod\n")
    (tmp_path / "site" / "broken_plugin_mod.py").write_text("raise ImportError('missing driver library')\n")
    code = ("import json, sys, crosstrain; from crosstrain import registry, pluginmanager; "
            "print(json.dumps({'backends': sorted(registry.backends()), "
            "'errors': [[e.name, e.error] for e in pluginmanager.load_errors()]}))")
    proc = _run(code, tmp_path / "site")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "cpu" in data["backends"]
    assert ["broken", "ImportError: missing driver library"] in data["errors"]
