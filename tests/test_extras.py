"""pyproject.toml's extras: `all` names every non-hardware extra; `serve` holds the docs' client (openai)."""

import ast
import re
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
HARDWARE = {"cpu", "cuda", "rocm", "npu"}


def _extras() -> dict[str, list[str]]:
    return tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]


def test_all_covers_every_non_hardware_extra() -> None:
    extras = _extras()
    (entry,) = extras["all"]
    named = set(re.fullmatch(r"crosstrain\[(.*)\]", entry).group(1).split(","))
    assert named == set(extras) - HARDWARE - {"all", "dev"}


def test_serve_has_the_openai_client() -> None:
    assert any(req.startswith("openai") for req in _extras()["serve"])


# ------------------------------------------------------------------------------- the docs name the extras they need
DOCS = PYPROJECT.parent / "docs"
PLUGINS = PYPROJECT.parent / "plugins"
#: commands that do nothing without an extra's package: command -> (its plugin, which imports it: checked; extra)
COMMAND_EXTRAS = {"report": ("observability", "observability"), "serve": ("serve", "serve"), "tune": ("tune", "tune"),
                  "fl": ("fl", "fl"), "k8s": ("k8s", "k8s")}
#: core features behind an extra, and the pages that document them
CORE_EXTRAS = {"tensorboard": ("training.md", "observability.md"), "hf": ("models.md",)}


def _named_extras(page: Path) -> set[str]:
    """Extras a page tells the reader to install: ``pip install "crosstrain[a,b]"`` (either quote)."""
    text = page.read_text()
    if "pip install" not in text:
        return set()
    return {x for group in re.findall(r"""['"]crosstrain\[([a-z0-9,]+)\]['"]""", text) for x in group.split(",")}


def _plugin_needs() -> dict[str, list[set[str]]]:
    """``{plugin: [extras that hold one package it imports, ...]}`` from its source's imports and the installed
    distributions (the dev environment has every extra's packages)."""
    from importlib.metadata import packages_distributions

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    holders: dict[str, set[str]] = {}
    for extra, reqs in _extras().items():
        if extra not in HARDWARE | {"all", "dev"}:
            for req in reqs:
                holders.setdefault(norm(re.match(r"[A-Za-z0-9_.-]+", req).group()), set()).add(extra)
    dists = packages_distributions()
    needs: dict[str, list[set[str]]] = {}
    for folder in sorted(p for p in PLUGINS.iterdir() if (p / "plugin.py").exists()):
        tops: set[str] = set()
        for source in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.Import):
                    tops |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops.add(node.module.split(".")[0])
        found = [set().union(*(holders.get(norm(d), set()) for d in dists.get(m, []))) for m in sorted(tops)]
        needs[folder.name] = [x for x in found if x]
    return needs


def test_each_plugin_page_names_the_extras_its_code_imports() -> None:
    needs = _plugin_needs()
    assert {"export"} in needs["export"] and {"fl"} in needs["fl"] and {"eval"} in needs["evaluate"]  # sees imports
    missing = sorted({f"docs/{plugin}.md lacks pip install \"crosstrain[{'|'.join(sorted(x))}]\""
                      for plugin, extras in needs.items() for x in extras
                      if not x & _named_extras(DOCS / f"{plugin}.md")})
    assert not missing, missing


def test_pages_showing_a_command_or_feature_behind_an_extra_name_it() -> None:
    needs = _plugin_needs()
    for command, (plugin, extra) in COMMAND_EXTRAS.items():
        assert any(extra in x for x in needs[plugin]), (command, extra)  # the plugin does import its packages
    missing = []
    for page in sorted(DOCS.glob("*.md")):
        named = _named_extras(page)
        text = page.read_text()
        missing += [f"{page.name} shows `crosstrain {c}` but not pip install \"crosstrain[{x}]\""
                    for c, (_, x) in COMMAND_EXTRAS.items() if re.search(rf"crosstrain {c}\b", text) and x not in named]
        missing += [f"{page.name} lacks pip install \"crosstrain[{x}]\"" for x, pages in CORE_EXTRAS.items()
                    if page.name in pages and x not in named]
    assert not missing, missing
    assert all(x in _extras() for x in CORE_EXTRAS)
