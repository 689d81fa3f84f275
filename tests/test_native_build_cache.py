"""The native extension is built once per source hash: setup.py's ``build_ext`` (backends/cpu/native/build.py) run
twice in fresh build folders, as pip does, compiles the first time and copies from the cache the second; a changed
source compiles again. A tiny C extension stands in for the real ones (which take minutes to compile)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from setuptools import Distribution, Extension

BUILD_PY = Path(__file__).resolve().parents[1] / "backends" / "cpu" / "native" / "build.py"

SOURCE = """#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(%d); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "tinyext", NULL, -1, methods};
PyMODINIT_FUNC PyInit_tinyext(void) { return PyModule_Create(&mod); }
"""


@pytest.fixture(scope="module")
def build_module():
    spec = importlib.util.spec_from_file_location("_crosstrain_native_build_test", BUILD_PY)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def _build(build_module, src: Path, work: Path) -> tuple[Path, list[Path]]:
    """One ``build_ext`` in a fresh folder (pip's isolated build); the built file and the objects compiled."""
    ext = Extension("tinyext", sources=[str(src)], extra_compile_args=["-O1"])
    dist = Distribution({"ext_modules": [ext], "script_name": "setup.py"})
    cmd = build_module.cached_build_ext()(dist)
    cmd.build_lib, cmd.build_temp = str(work / "lib"), str(work / "temp")
    cmd.ensure_finalized()
    cmd.run()
    built = Path(cmd.get_ext_fullpath("tinyext"))
    return built, list((work / "temp").rglob("*.o"))


def _answer(built: Path) -> int:
    out = subprocess.run([sys.executable, "-c", "import tinyext; print(tinyext.answer())"], cwd=built.parent,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return int(out)


def test_second_build_comes_from_the_cache_and_a_changed_source_recompiles(build_module, tmp_path, monkeypatch,
                                                                          capfd) -> None:
    monkeypatch.setenv("CROSSTRAIN_NATIVE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "tinyext.c"
    src.write_text(SOURCE % 41)
    built, objects = _build(build_module, src, tmp_path / "first")
    assert objects and _answer(built) == 41
    assert "built and cached as" in capfd.readouterr().err
    cached = list((tmp_path / "cache").glob("*/tinyext*"))
    assert len(cached) == 1

    built, objects = _build(build_module, src, tmp_path / "second")
    assert objects == []  # nothing compiled
    err = capfd.readouterr().err
    assert f"native extension tinyext: using the cached build {cached[0]}" in err
    assert _answer(built) == 41

    src.write_text(SOURCE % 42)
    built, objects = _build(build_module, src, tmp_path / "third")
    assert objects and _answer(built) == 42
    assert len(list((tmp_path / "cache").glob("*/tinyext*"))) == 2


def test_the_key_follows_sources_flags_and_compiler(build_module, tmp_path) -> None:
    src = tmp_path / "a.c"
    src.write_text("int x;\n")
    base = build_module.cache_key(Extension("m", [str(src)], extra_compile_args=["-O3"]), ["gcc"])
    assert base == build_module.cache_key(Extension("m", [str(src)], extra_compile_args=["-O3"]), ["gcc"])
    assert base != build_module.cache_key(Extension("m", [str(src)], extra_compile_args=["-O2"]), ["gcc"])
    assert base != build_module.cache_key(Extension("m", [str(src)], extra_compile_args=["-O3"]), ["clang"])
    src.write_text("int y;\n")
    assert base != build_module.cache_key(Extension("m", [str(src)], extra_compile_args=["-O3"]), ["gcc"])
