"""pyproject.toml's extras: `all` names every non-hardware extra; `serve` holds the docs' client (openai)."""

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
