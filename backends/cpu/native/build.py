"""Declares the native CPU extensions for ``setup.py`` (``ext_modules()``): ``_C`` (the fused optimizer steps)
and ``_kernels`` (the model ops rms_norm, rotary_embedding, swiglu, cross-entropy; sources in ``csrc/ops``).

The extension is plain C++ on raw buffers (no torch headers, so no dependency on torch's C++ ABI), bound
with pybind11, threaded with OpenMP when the compiler supports ``-fopenmp``. Instruction sets are chosen
at run time (AVX-512 / AVX2 variants compiled with ``#pragma GCC target``), so no ``-march`` flag is used
and the wheel runs on any x86-64 CPU. Without a working C++ compiler (or without pybind11, or with
``CROSSTRAIN_NO_NATIVE=1``) the install still succeeds and the extension is reported missing at run time.

Each extension is built once per :func:`cache_key` (sources, headers, flags, compiler, Python ABI, pybind11 and
torch versions) and kept under :func:`cache_dir`; a later install (pip builds in a fresh folder every time) copies
it from there and prints ``native extension ...: using the cached build ...`` (:func:`cached_build_ext`).
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile

from setuptools import Extension

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")
MODULE = "crosstrain.backends.cpu.native._C"
#: the model-op kernels (rms_norm, rotary, swiglu, cross-entropy): a separate module, so rebuilding one never
#: touches the other
OPS_MODULE = "crosstrain.backends.cpu.native._kernels"
OPS_CSRC = os.path.join(CSRC, "ops")


def _relative(path: str) -> str:
    """setuptools wants source paths relative to the project root (where setup.py runs)."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _is_x86() -> bool:
    return platform.machine().lower() in {"x86_64", "amd64", "i686", "i386"}


def _warn(message: str) -> None:
    print(f"crosstrain: {message}", file=sys.stderr)


def _compiles(flags: list[str], source: str = "int main() { return 0; }\n") -> bool:
    """Whether the compiler setuptools will use can compile and link a tiny C++ program with ``flags``."""
    try:
        from setuptools._distutils.ccompiler import new_compiler
        from setuptools._distutils.sysconfig import customize_compiler
    except ImportError:  # pragma: no cover - very old setuptools
        return True
    compiler = new_compiler()
    customize_compiler(compiler)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as fh:
            fh.write(source)
        try:
            with open(os.devnull, "w") as devnull:
                saved = os.dup(2)
                os.dup2(devnull.fileno(), 2)
                try:
                    objects = compiler.compile([src], output_dir=tmp, extra_postargs=["-std=c++17", *flags])
                    compiler.link_executable(objects, "probe", output_dir=tmp, extra_postargs=flags,
                                             target_lang="c++")
                finally:
                    os.dup2(saved, 2)
                    os.close(saved)
        except Exception:
            return False
    return True


#: the per-file instruction-set switch the AVX2 / AVX-512 sources rely on
_SIMD_PROBE = """#include <immintrin.h>
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
__m512 twice(__m512 a) { return _mm512_add_ps(a, a); }
int main() { return 0; }
"""


def ext_modules() -> list[Extension]:
    """The native extensions, or ``[]`` when they cannot be built here (reported at run time instead)."""
    if os.environ.get("CROSSTRAIN_NO_NATIVE", "").strip() not in ("", "0"):
        _warn("CROSSTRAIN_NO_NATIVE is set; building without the native CPU optimizer kernels")
        return []
    try:
        import pybind11
    except ImportError:
        _warn("pybind11 is not installed; building without the native CPU optimizer kernels")
        return []
    if sys.platform == "win32":
        _warn("the native CPU optimizer kernels are built with GCC/Clang only; skipping them on Windows")
        return []
    if not _compiles([]):
        _warn("no working C++17 compiler found; building without the native CPU optimizer kernels "
              "(install g++ and reinstall to get them)")
        return []
    openmp = _compiles(["-fopenmp"], "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
    if not openmp:
        _warn("the C++ compiler has no OpenMP; the native optimizer kernels will run on one thread")
    sources = ["module.cpp", "isa_generic.cpp"]
    macros: list[tuple[str, str | None]] = []
    if _is_x86() and _compiles([], _SIMD_PROBE):
        sources += ["isa_avx2.cpp", "isa_avx512.cpp"]
        macros.append(("CROSSTRAIN_X86", "1"))
    elif _is_x86():
        _warn("the C++ compiler cannot target AVX2/AVX-512 per file; building the portable kernels only")
    compile_args = ["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden",
                    "-Wno-maybe-uninitialized"]  # GCC 12 false positives inside avx512fintrin.h
    link_args: list[str] = []
    if openmp:
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")
    ops_sources = ["ops_module.cpp", "ops_generic.cpp"]
    if macros:
        ops_sources += ["ops_avx2.cpp", "ops_avx512.cpp"]
    # -fopenmp-simd: `#pragma omp simd` reductions vectorise without -ffast-math (and without libgomp);
    # -fno-trapping-math lets the clamps in exp / the bf16 NaN test become blends (no FP exceptions are used).
    # FMA contraction is allowed here (unlike the optimizer, these ops match their references to ~1e-6, not bits).
    ops_args = ["-std=c++17", "-O3", "-fno-math-errno", "-fno-trapping-math", "-fvisibility=hidden", "-fopenmp-simd"]
    if openmp:
        ops_args.append("-fopenmp")
    # A compiler that cannot build the ops (too old for __builtin_bit_cast, ...) skips them with a warning instead
    # of failing the install; at run time the model ops then use the references (one warning).
    ops = _extension(OPS_MODULE, OPS_CSRC, ops_sources, ("ops_common.h", "ops_impl.h"), pybind11.get_include(),
                     macros, ops_args, link_args, optional=True)
    optim = _extension(MODULE, CSRC, sources, ("common.h", "convert.h", "kernels_impl.h"), pybind11.get_include(),
                       macros, compile_args, link_args)
    return [ops, optim]


def _extension(module: str, folder: str, sources: list[str], headers: tuple[str, ...], pybind_include: str,
               macros: list[tuple[str, str | None]], compile_args: list[str], link_args: list[str],
               optional: bool | None = None) -> Extension:
    """A C++ extension built from ``sources`` in ``folder``, rebuilt when one of its ``headers`` changes."""
    return Extension(
        module,
        sources=[_relative(os.path.join(folder, s)) for s in sources],
        include_dirs=[pybind_include, _relative(folder)],
        define_macros=macros,
        language="c++",
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        depends=[_relative(os.path.join(folder, h)) for h in headers],
        optional=optional,
    )


def cache_dir() -> str:
    """Where built extensions are kept for later installs: ``$CROSSTRAIN_NATIVE_CACHE``, else
    ``$XDG_CACHE_HOME/crosstrain/native`` (``~/.cache/crosstrain/native``)."""
    explicit = os.environ.get("CROSSTRAIN_NATIVE_CACHE", "").strip()
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "crosstrain", "native")


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "none"


def cache_key(ext: Extension, compiler: list[str]) -> str:
    """SHA-256 of everything the built file depends on: the bytes of its sources and headers, its flags and
    macros, the compiler command, the Python ABI (the file suffix), pybind11's and torch's versions."""
    import hashlib
    import sysconfig

    h = hashlib.sha256()
    for path in sorted({*ext.sources, *ext.depends}):
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    meta = [ext.name, ext.extra_compile_args, ext.extra_link_args, sorted(map(str, ext.define_macros)),
            compiler, sysconfig.get_config_var("EXT_SUFFIX"), platform.machine(),
            _package_version("pybind11"), _package_version("torch")]
    h.update(repr(meta).encode())
    return h.hexdigest()[:32]


def cached_build_ext() -> type:
    """setuptools' ``build_ext`` that builds each extension once per :func:`cache_key` and copies it from
    :func:`cache_dir` afterwards, so ``pip install -e ".[hf]"`` after ``pip install -e .`` does not recompile
    (pip builds in a fresh temporary folder each time, where setuptools' own up-to-date check never applies)."""
    import shutil

    from setuptools.command.build_ext import build_ext

    class CachedBuildExt(build_ext):
        def build_extension(self, ext: Extension) -> None:
            compiler = list(getattr(self.compiler, "compiler_so", None) or [type(self.compiler).__name__])
            key = cache_key(ext, compiler)
            target = self.get_ext_fullpath(ext.name)
            cached = os.path.join(cache_dir(), key, os.path.basename(target))
            if os.path.isfile(cached):
                os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
                shutil.copyfile(cached, target)
                _warn(f"native extension {ext.name}: using the cached build {cached} (same sources, flags and "
                      "compiler)")
                return
            super().build_extension(ext)
            if not os.path.isfile(target):
                return  # an optional extension that failed: nothing to keep
            try:
                os.makedirs(os.path.dirname(cached), exist_ok=True)
                partial = f"{cached}.{os.getpid()}.partial"
                shutil.copyfile(target, partial)
                os.replace(partial, cached)  # a concurrent install sees the whole file or none
                _warn(f"native extension {ext.name}: built and cached as {cached}")
            except OSError as exc:  # a read-only home must not fail the install
                _warn(f"native extension {ext.name}: built, not cached ({exc})")

    return CachedBuildExt
