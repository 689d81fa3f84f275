"""The CLI answers without importing the stack: ``--help``, ``--version`` and a command's ``--help`` run in a fresh
interpreter and leave torch, numpy and transformers out of ``sys.modules`` (what they import is host-independent,
unlike how long it takes: benchmarks/cli.py times it). Plugins' commands are still listed, and a plugin that adds
no command is not even imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "numpy", "transformers", "pydantic")

# runs the CLI in-process, then reports (on the last stdout line) which modules it left imported
_PROBE = """
import json, sys
from crosstrain.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
mods = sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r} or m.startswith('crosstrain.'))
print(json.dumps({{"code": code, "modules": mods}}))
"""


def _cli(*args: str, extra_path: Path | None = None) -> tuple[dict, str, str]:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY), *args], capture_output=True, text=True,
                          env=env, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr
    return json.loads(lines[-1]), "\n".join(lines[:-1]), proc.stderr


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in HEAVY]


def test_version_imports_no_plugin_and_no_torch() -> None:
    result, out, err = _cli("--version")
    assert result["code"] == 0, err
    assert out.startswith("crosstrain 0.")
    assert _heavy(result["modules"]) == []
    assert [m for m in result["modules"] if m.startswith(("crosstrain.plugins", "crosstrain.backends"))] == []


@pytest.mark.parametrize("args", [("train", "--help"), ("eval", "--help"), ("config", "--help")])
def test_core_command_help_imports_no_torch_and_no_backend(args: tuple[str, ...]) -> None:
    result, out, err = _cli(*args)
    assert result["code"] == 0, err
    assert f"usage: crosstrain {args[0]}" in out
    assert _heavy(result["modules"]) == []
    assert [m for m in result["modules"] if m.startswith("crosstrain.backends") and m.endswith(".plugin")] == []
    if args[0] == "train":
        assert "--profile-steps" in out  # the observability plugin's flag on a core command


def test_help_lists_plugin_commands_without_importing_torch_or_any_backend() -> None:
    result, out, err = _cli("--help")
    assert result["code"] == 0, err
    assert _heavy(result["modules"]) == []
    # finding a plugin's source imports its package's __init__, never its module: no backend adds a command
    assert [m for m in result["modules"] if m.startswith("crosstrain.backends") and m.endswith(".plugin")] == []
    for command in ("train", "config", "export", "generate", "serve", "tune", "distill", "report", "fl"):
        assert f"    {command} " in out or f"    {command}\n" in out, command


def test_a_plugin_command_help_lists_flags_other_plugins_add_without_torch() -> None:
    result, out, err = _cli("export", "--help")
    assert result["code"] == 0, err
    assert _heavy(result["modules"]) == []
    assert "--quantize" in out and "--int8-tolerance" in out  # the compress plugin's flag, the export's own


def test_a_plugin_without_commands_is_not_imported_and_one_with_commands_is_listed(tmp_path: Path) -> None:
    site = tmp_path / "site"
    dist = site / "thirdparty-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[crosstrain]\nzz_nocmd = zz_nocmd_mod\nzz_cmd = zz_cmd_mod\n")
    (site / "zz_nocmd_mod.py").write_text("raise ImportError('a backend whose driver is missing')\n")
    (site / "zz_cmd_mod.py").write_text(
        "import crosstrain\n\n"
        "@crosstrain.hookimpl\n"
        "def crosstrain_add_commands(subparsers):\n"
        "    p = subparsers.add_parser('hello3p', help='a third-party command')\n"
        "    p.add_argument('--loud', action='store_true', help='shout it')\n"
        "    p.set_defaults(func=lambda args: print('HELLO' if args.loud else 'hello') or 0)\n")
    result, out, err = _cli("--help", extra_path=site)
    assert result["code"] == 0, err
    assert "hello3p" in out and "a third-party command" in out
    assert "missing" not in err  # the plugin without commands was never imported, so it could not fail
    result, out, err = _cli("hello3p", "--loud", extra_path=site)
    assert result["code"] == 0 and out == "HELLO", err
    assert _heavy(result["modules"]) == []
