"""The plugin manager's contract: wrappers, ``firstresult``, plugin-added hook specs, every hook implemented by a
shipped plugin, and ``crosstrain plugins`` in a fresh interpreter."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from crosstrain import hookimpl, hookspecs, pluginmanager
from crosstrain.config import load_config
from crosstrain.config.schema import CORE_SECTIONS
from crosstrain.engine.recipe import resolve_recipe
from crosstrain.errors import ConfigError, PluginError
from crosstrain.recipes.lm import LMRecipe


class _Specs:
    """Hooks a test plugin adds through ``crosstrain_add_hookspecs``."""

    @hookspecs.hookspec
    def crosstrain_test_values(self, x: int) -> int:  # type: ignore[empty-body]
        """Each plugin's value for ``x``."""

    @hookspecs.hookspec(firstresult=True)
    def crosstrain_test_first(self, x: int) -> int | None:  # type: ignore[empty-body]
        """The first plugin's value for ``x``."""


class _AddsSpecs:
    @hookimpl
    def crosstrain_add_hookspecs(self, pluginmanager):
        pluginmanager.add_hookspecs(_Specs)


class _Value:
    def __init__(self, value: int, log: list, fail: bool = False) -> None:
        self.value, self.log, self.fail = value, log, fail

    @hookimpl
    def crosstrain_test_values(self, x):
        self.log.append(("impl", self.value))
        if self.fail:
            raise ConnectionError(f"plugin {self.value} is down")
        return self.value * x

    @hookimpl
    def crosstrain_test_first(self, x):
        self.log.append(("first", self.value))
        return self.value * x if self.value else None


class _Wrapper:
    """A new-style wrapper: sees the results (or the exception) and may replace the results."""

    def __init__(self, log: list, add: int = 0, tag: str = "new") -> None:
        self.log, self.add, self.tag = log, add, tag

    @hookimpl(wrapper=True)
    def crosstrain_test_values(self, x):
        self.log.append((self.tag, "before"))
        try:
            results = yield
        except Exception as exc:
            self.log.append((self.tag, "saw", type(exc).__name__))
            raise
        self.log.append((self.tag, "after", list(results)))
        return [r + self.add for r in results]


class _OldWrapper:
    def __init__(self, log: list) -> None:
        self.log = log

    @hookimpl(hookwrapper=True, tryfirst=True)
    def crosstrain_test_values(self, x):
        self.log.append(("old", "before"))
        outcome = yield
        self.log.append(("old", "after", outcome.get_result()))


@pytest.fixture
def specs(plugin):
    """The ``plugin`` fixture, with ``_Specs`` added (once per process: a spec cannot be removed)."""
    caller = getattr(pluginmanager.plugin_manager().hook, "crosstrain_test_values", None)
    if caller is None or caller.spec is None:
        plugin(_AddsSpecs(), "adds-specs")
    return plugin


def test_a_plugin_adds_its_own_hook_specs(specs) -> None:
    caller = pluginmanager.plugin_manager().hook.crosstrain_test_values
    assert caller.spec is not None and caller.spec.namespace is _Specs and caller.spec.argnames == ("x",)
    # the shipped plugins add theirs the same way
    hook = pluginmanager.plugin_manager().hook
    assert hook.crosstrain_export_state_dict.spec.namespace.__name__ == "crosstrain.plugins.export.hookspecs"
    assert hook.crosstrain_report_panels.spec.namespace.__name__ == "crosstrain.plugins.observability.panels"


def test_wrappers_run_around_every_implementation_outermost_first(specs) -> None:
    log: list = []
    specs(_Value(1, log), "one")
    specs(_Wrapper(log, add=10), "wrap")
    specs(_Value(2, log), "two")
    specs(_OldWrapper(log), "old-wrap")  # tryfirst: outermost although registered last
    assert pluginmanager.call_each("crosstrain_test_values", x=3) == [("one", 13), ("two", 16)]
    assert log == [("old", "before"), ("new", "before"), ("impl", 1), ("impl", 2),
                   ("new", "after", [3, 6]), ("old", "after", [13, 16])]
    assert [i.plugin_name for i in pluginmanager.ordered_impls("crosstrain_test_values")] == ["one", "two"]
    assert [i.plugin_name for i in pluginmanager.hook_wrappers("crosstrain_test_values")] == ["old-wrap", "wrap"]


def test_call_strict_throws_a_failure_into_the_wrappers_then_stops(specs) -> None:
    log: list = []
    specs(_Wrapper(log), "wrap")
    specs(_Value(1, log, fail=True), "down")
    specs(_Value(2, log), "never")
    with pytest.raises(PluginError, match=r"^plugin 'down' failed to add values: ConnectionError: plugin 1 is down$"):
        pluginmanager.call_strict("crosstrain_test_values", "add values", x=1)
    assert log == [("new", "before"), ("impl", 1), ("new", "saw", "PluginError")]


def test_call_each_reports_a_failing_implementation_and_keeps_the_rest(specs) -> None:
    log: list = []
    specs(_Value(1, log, fail=True), "down")
    specs(_Value(2, log), "up")
    seen: list = []
    assert pluginmanager.call_each("crosstrain_test_values", x=1, on_error=lambda n, e: seen.append(n)) == [("up", 2)]
    assert seen == ["down"]


def test_a_wrapper_that_drops_results_is_reported_and_changes_nothing(specs) -> None:
    class Dropper:
        @hookimpl(wrapper=True)
        def crosstrain_test_values(self, x):
            yield
            return []

    log: list = []
    specs(_Value(1, log), "one")
    specs(Dropper(), "dropper")
    seen: list = []
    assert pluginmanager.call_each("crosstrain_test_values", x=5, on_error=lambda n, e: seen.append((n, str(e)))) \
        == [("one", 5)]
    assert seen == [("dropper", "plugin 'dropper': its wrapper of crosstrain_test_values returned []; return the "
                                "list of 1 results it was given (changed or not)")]
    with pytest.raises(PluginError, match=r"^plugin 'dropper': its wrapper of crosstrain_test_values returned \[\]"):
        pluginmanager.call_strict("crosstrain_test_values", "add values", x=5)


def test_firstresult_stops_at_the_first_answer(specs) -> None:
    log: list = []
    specs(_Value(0, log), "abstains")
    specs(_Value(2, log), "answers")
    specs(_Value(3, log), "never-asked")
    assert pluginmanager.call_strict("crosstrain_test_first", "answer", x=5) == [("abstains", None), ("answers", 10)]
    assert log == [("first", 0), ("first", 2)]


def test_the_first_plugin_recipe_wins_and_later_ones_are_not_asked(plugin) -> None:
    asked: list[str] = []

    class Provides:
        def __init__(self, tag: str) -> None:
            self.tag = tag

        @hookimpl
        def crosstrain_recipe(self, name):
            asked.append(self.tag)
            if name != "dup_lm":
                return None
            recipe = LMRecipe()
            recipe.name = f"dup_lm_{self.tag}"
            return recipe

    plugin(Provides("a"), "provides-a")
    plugin(Provides("b"), "provides-b")
    assert resolve_recipe("dup_lm").name == "dup_lm_a"
    assert asked == ["a"]


def _shipped_plugins() -> dict[str, object]:
    pm = pluginmanager.plugin_manager()
    return {ep.name: pm.get_plugin(ep.name) for ep in entry_points(group="crosstrain")}


def test_every_hook_has_a_shipped_implementer() -> None:
    pm = pluginmanager.plugin_manager()
    shipped = {name: plugin for name, plugin in _shipped_plugins().items() if plugin is not None}
    core_specs = [n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("crosstrain_")]
    plugin_specs = ["crosstrain_export_state_dict", "crosstrain_report_panels"]
    missing = []
    for hook in [*core_specs, *plugin_specs]:
        implementers = {i.plugin_name for i in getattr(pm.hook, hook).get_hookimpls()}
        if not implementers & set(shipped):
            missing.append(hook)
    assert not missing, f"hooks no shipped plugin implements: {missing}"


def test_moe_and_rlhf_bring_their_own_report_panels() -> None:
    panels = {name: sorted(p.id for p in found)
              for name, found in pluginmanager.call_each("crosstrain_report_panels")}
    assert panels == {"moe": ["moe_max_load"], "rlhf": ["rlhf_kl", "rlhf_rewards"],
                      "compress": ["distill_kd", "distill_nll"], "evaluate": ["eval_tasks"],
                      "vision": ["classify_accuracy", "classify_recall", "detect_map"]}


def test_the_observability_section_belongs_to_its_plugin(tmp_path) -> None:
    assert "observability" not in CORE_SECTIONS
    config = load_config(None, ["observability.per_rank=false", "observability.hang_dump_s=5"])
    section = config.section("observability")
    assert type(section).__module__ == "crosstrain.plugins.observability.config"
    assert section.per_rank is False and section.hang_dump_s == 5
    with pytest.raises(ConfigError, match=r"^invalid value for 'observability.profile_steps': .*2:9 ends after the "
                                          r"last step \(train.steps=4\).*pick A:B with B <= 4"):
        load_config(None, ["train.steps=4", "observability.profile_steps=2:9"])


def _third_party_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    dist = site / "crosstrain_demo-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: crosstrain-demo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[crosstrain]\ndemo = crosstrain_demo\n")
    (site / "crosstrain_demo.py").write_text(
        "from pydantic import BaseModel\n"
        "from crosstrain import hookimpl\n"
        "from crosstrain.recipes.lm import LMRecipe\n\n"
        "class DemoSection(BaseModel):\n    level: int = 1\n\n"
        "class DemoRecipe(LMRecipe):\n    name = 'demo_lm'\n\n"
        "@hookimpl\ndef crosstrain_recipe(name):\n    return DemoRecipe() if name == 'demo_lm' else None\n\n"
        "@hookimpl\ndef crosstrain_recipe_names():\n    return ['demo_lm']\n\n"
        "@hookimpl\ndef crosstrain_config_sections():\n    return {'demo': DemoSection}\n")
    return site


def _crosstrain(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "crosstrain", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_crosstrain_plugins_lists_what_each_plugin_brings(tmp_path) -> None:
    site = _third_party_site(tmp_path)
    proc = _crosstrain(site, "plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    data = {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}
    assert data["core"]["recipes"] == ["lm"]
    assert data["demo"]["recipes"] == ["demo_lm"] and data["demo"]["config_sections"] == ["demo"]
    assert data["demo"]["source"] == "crosstrain_demo"
    assert data["demo"]["hooks"] == ["crosstrain_config_sections", "crosstrain_recipe", "crosstrain_recipe_names"]
    assert data["rlhf"]["recipes"] == ["sft", "rm", "dpo", "grpo", "ppo"]
    assert "crosstrain_report_panels" in data["moe"]["hooks"] and data["moe"]["config_sections"] == ["moe"]
    assert data["observability"]["config_sections"] == ["observability"]
    assert data["cpu"]["backends"] == ["cpu"]
    assert json.loads(proc.stdout)["plugin_errors"] == []

    text = _crosstrain(site, "plugins")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    at = lines.index("demo (crosstrain_demo)")
    assert lines[at + 1:at + 3] == ["  recipes: demo_lm", "  config sections: demo"]

    unknown = _crosstrain(site, "train", "--recipe", "nope", "--set", f"train.output_dir={tmp_path / 'runs'}")
    assert unknown.returncode == 2
    (line,) = unknown.stderr.strip().splitlines()
    assert "train.recipe='nope' is not a known recipe" in line and "demo_lm" in line
    assert line.endswith("(plugins add more; `crosstrain plugins` lists the loaded plugins and their recipes)")
    assert not (tmp_path / "runs").exists()
