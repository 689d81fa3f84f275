"""``crosstrain config show|explain`` and the commented config.toml: every key of every loaded section (core and each
plugin's) is listed with its default, type and description, and a key without a description fails here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import BaseModel

from crosstrain.config import load_config, save_config
from crosstrain.config.loader import config_from_dict, plugin_sections
from crosstrain.config.schema import CORE_SECTIONS, Config
from crosstrain.config.toml_io import read_toml


def _all_sections() -> dict[str, type[BaseModel]]:
    return {**CORE_SECTIONS, **plugin_sections()}


def _toml_keys(name: str, model: type[BaseModel]) -> list[str]:
    return [f"{name}.{field.alias or attr}" for attr, field in model.model_fields.items()]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "crosstrain", *args], capture_output=True, text=True, timeout=300)


def test_every_key_of_every_loaded_section_has_a_description() -> None:
    sections = _all_sections()
    assert {"moe", "rlhf", "export", "observability", "fl", "tune", "distill", "quant"} <= set(sections)
    missing = [key for name, model in sections.items() for key, field in zip(_toml_keys(name, model),
                                                                             model.model_fields.values(), strict=True)
               if not (field.description or "").strip()]
    missing += [] if (Config.model_fields["backend"].description or "").strip() else ["backend"]
    assert missing == [], f"config keys without a description: {missing}"


def test_show_json_lists_every_key_with_default_type_and_description_without_torch() -> None:
    probe = ("import json, runpy, sys; sys.argv = ['crosstrain', 'config', 'show', '--json', '--set', 'optim.lr=1e-3', "
             "'--recipe', 'dpo']\ntry:\n    runpy.run_module('crosstrain', run_name='__main__')\nexcept SystemExit:\n"
             "    pass\nprint(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    *body, heavy = proc.stdout.strip().splitlines()
    assert json.loads(heavy) == []
    keys = {k["key"]: k for k in json.loads("\n".join(body))["keys"]}
    expected = ["backend", *(key for name, model in _all_sections().items() for key in _toml_keys(name, model))]
    assert sorted(keys) == sorted(expected)
    assert all(k["description"] and k["type"] and "default" in k for k in keys.values())
    assert keys["optim.lr"]["value"] == 1e-3 and keys["optim.lr"]["default"] == 3e-3
    assert keys["train.recipe"]["value"] == "dpo"
    assert keys["checkpoint.async"]["type"] == "bool"  # the TOML name, not the attribute's
    assert keys["optim.betas"] == {**keys["optim.betas"], "type": "tuple[float, float]", "default": [0.9, 0.95]}
    assert keys["parallel.compile"]["type"] == "'auto' | bool"


def test_show_text_and_explain_one_key() -> None:
    proc = _cli("config", "show", "--set", "moe.router=sigmoid")
    assert proc.returncode == 0, proc.stderr
    assert "[moe]" in proc.stdout and 'router = "sigmoid"  (default "softmax")' in proc.stdout
    proc = _cli("config", "explain", "checkpoint.keep_last")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "checkpoint.keep_last: int, default 3"
    assert CORE_SECTIONS["checkpoint"].model_fields["keep_last"].description in proc.stdout


@pytest.mark.parametrize("args, words", [
    (("config", "explain", "optim.lrr"), ["unknown config key 'optim.lrr'", "optim.lr"]),
    (("config", "show", "--set", "optim.lr=-1"), ["optim.lr", "greater than 0"]),
    (("config", "show", "--set", "nosuch.key=1"), ["unknown config section 'nosuch'"]),
])
def test_bad_keys_are_one_line_errors_with_exit_2(args: tuple[str, ...], words: list[str]) -> None:
    proc = _cli(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("crosstrain: error: ")
    assert all(w in lines[0] for w in words), lines[0]


def test_run_config_toml_carries_each_description_and_loads_back_equal(tmp_path) -> None:
    config = load_config(None, ["optim.lr=1e-3", "model.options={depth = 2}", "moe.experts=4"])
    save_config(config, tmp_path)
    text = (tmp_path / "config.toml").read_text()
    lines = text.splitlines()
    lr = lines.index("lr = 0.001")
    assert lines[lr - 1] == f"# {CORE_SECTIONS['optim'].model_fields['lr'].description} (float, default 0.003)"
    assert "# routed experts per MoE layer; 0 = dense model (int, default 0)" in lines
    assert sum(line.startswith("# ") for line in lines) >= 150
    again = config_from_dict(read_toml(tmp_path / "config.toml"))
    assert again.to_dict() == config.to_dict()
    assert json.loads((tmp_path / "config.json").read_text()) == config.to_dict()
