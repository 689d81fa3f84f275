"""What the fast defaults chose, and why: ``parallel.compile = "auto"``, the kernels, and the report.

``parallel.compile = "auto"`` compiles when it pays: when the time compile is expected to save over the run's
steps exceeds what compiling is expected to cost (:func:`compile_pays`). Both come from a record crosstrain keeps
next to its inductor cache for this model shape, layout, precision, batch shape and torch version
(``~/.cache/crosstrain/compile/<key>.json``): the compile seconds the last compiled run measured (a warm compile
once torch's on-disk inductor, FX-graph and AOTAutograd caches hold the kernels), and the median step time of
the last compiled and the last eager run. With no record, a cold compile (:data:`COLD_COMPILE_S`) is weighed
against :data:`EXPECTED_GAIN` of an estimated step time, which keeps short runs eager. Never on a layout that
does not compile (``tp > 1``, see :func:`crosstrain.parallel.parallelize`), nor by itself on pipeline or expert
parallel layouts (untested with compile), nor on a model without block units to compile.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from crosstrain.checkpoint.atomic import atomic_write
from crosstrain.checkpoint.space import NoSpaceError, file_size_limit
from crosstrain.errors import ConfigError

#: files the C++ compiler writes for one compiled block reach tens of MB; a file-size limit below this kills it.
COMPILE_FILE_BYTES = 1 << 30
#: a cold per-block inductor compile of a GPT on the host, forward and backward (measured: 20-60 s on 2 cores).
COLD_COMPILE_S = 40.0
#: the share of a step compile is expected to save (fused element-wise ops around the matmuls).
EXPECTED_GAIN = 0.15
#: the eager MFU assumed to estimate a step's time before any step ran.
EAGER_MFU = 0.3


@dataclass(frozen=True)
class CompileChoice:
    """Whether the primary model is compiled, why, and (``auto``) the two figures weighed."""

    enabled: bool
    reason: str
    key: str = ""
    estimate_s: float = 0.0  # what compiling this run is expected to cost
    saving_s: float = 0.0  # what compiling is expected to save over the run's steps

    @property
    def decision(self) -> str:
        return "compile" if self.enabled else "eager"


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/crosstrain`` (``~/.cache/crosstrain``): per user, like the CPU peak-FLOP/s cache."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "crosstrain"


def host_isa() -> str:
    """The vector ISA ATen's CPU kernels (and inductor's generated C++) use in this process: ``avx512``, ``avx2``,
    ``default``... (``ATEN_CPU_CAPABILITY`` can lower it). Kernels cached under one ISA crashed a process that picked
    another (heap corruption, docs/speed.md), so the caches are kept per ISA."""
    return torch.backends.cpu.get_cpu_capability().lower()


def enable_compile_caches() -> Path:
    """Point torch's on-disk compile caches under :func:`cache_root` (unless the user set them), one folder per
    :func:`host_isa`, and turn on the FX-graph and AOTAutograd caches; returns the inductor cache dir."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:  # torch writes its default (under /tmp) into the variable the first time anything asks for the dir
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        torch_default = os.path.abspath(default_cache_dir())
    except (ImportError, AttributeError):
        torch_default = None
    if current is None or os.path.abspath(current) == torch_default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor" / host_isa())
    inductor = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    try:
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = True
        functorch_config.enable_autograd_cache = True
    except (ImportError, AttributeError):  # a torch without these caches: compile still works, from scratch
        pass
    return inductor


def model_key(module: torch.nn.Module, dims: Any, precision: str, micro_batch: int, seq_len: int) -> str:
    """A stable key for "this model compiled this way": class, parameter shapes, layout, precision, batch shape."""
    shapes = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
    text = json.dumps([type(module).__name__, shapes, dims.describe(), precision, micro_batch, seq_len,
                       torch.__version__, host_isa()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _record_path(key: str) -> Path:
    return cache_root() / "compile" / f"{key}.json"


def read_record(key: str) -> dict[str, Any] | None:
    try:
        data = json.loads(_record_path(key).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_record(key: str, **measured: float) -> None:
    """Merge ``measured`` (``compile_s``, ``compiled_step_s``, ``eager_step_s``) into ``key``'s record."""
    path = _record_path(key)
    data = {**(read_record(key) or {}), **measured, "torch": torch.__version__}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(data) + "\n")
    except (OSError, NoSpaceError):  # a read-only or full home: the next run decides without the record
        pass


def compile_pays(steps: int, record: dict[str, Any] | None, est_step_s: float) -> tuple[float, float, str]:
    """``(estimated compile cost s, estimated saving s, how)`` of compiling a run of ``steps`` steps.

    Cost: the record's measured ``compile_s`` (the last compile of this key, warm once the cache holds it), else
    :data:`COLD_COMPILE_S`. Saving: ``steps x`` the per-step saving: eager minus compiled median step time when
    the record has both, else :data:`EXPECTED_GAIN` of the recorded eager step (or of ``est_step_s``)."""
    rec = record or {}
    cost = float(rec["compile_s"]) if "compile_s" in rec else COLD_COMPILE_S
    source = "measured" if "compile_s" in rec else "cold default"
    eager, compiled = rec.get("eager_step_s"), rec.get("compiled_step_s")
    if eager is not None and compiled is not None:
        per_step, how = max(float(eager) - float(compiled), 0.0), f"eager {eager:.3f} s - compiled {compiled:.3f} s"
    elif eager is not None:
        per_step, how = float(eager) * EXPECTED_GAIN, f"{EXPECTED_GAIN:.0%} of eager {eager:.3f} s"
    else:
        per_step, how = est_step_s * EXPECTED_GAIN, f"{EXPECTED_GAIN:.0%} of ~{est_step_s:.3f} s (estimated)"
    saving = steps * per_step
    return cost, saving, f"saving {saving:.1f} s ({steps} steps x ({how})) vs compile {cost:.1f} s ({source})"


def decide_compile(requested: Any, dims: Any, has_units: bool, steps: int, est_step_s: float, key: str
                   ) -> CompileChoice:
    """Whether to compile (see the module docstring); ``requested`` is ``parallel.compile``."""
    if requested is False:
        return CompileChoice(False, "parallel.compile=false", key)
    limit = file_size_limit()
    if limit is not None and limit < COMPILE_FILE_BYTES:  # the C++ compiler dies of SIGXFSZ writing its objects
        if requested != "auto":
            raise ConfigError(f"parallel.compile={requested!r} cannot compile under a file-size limit of "
                              f"{limit >> 20} MB (ulimit -f): the C++ compiler cannot write its files; raise it "
                              "(ulimit -f unlimited) or set parallel.compile=false")
        return CompileChoice(False, f"a file-size limit (ulimit -f, {limit >> 20} MB) stops the C++ compiler", key)
    if requested is not True and requested != "auto":
        return CompileChoice(True, f"parallel.compile={requested!r}", key)
    if requested is True:
        return CompileChoice(True, "parallel.compile=true", key)
    if dims.tp > 1:
        return CompileChoice(False, "parallel.tp > 1 does not compile in this torch build", key)
    if dims.pp > 1 or dims.ep > 1:  # compile is tested with DDP and FSDP2 blocks only (tests/test_parallel_parity)
        return CompileChoice(False, "auto compiles DDP/FSDP2 layouts only (parallel.pp/ep > 1); "
                             "parallel.compile=true forces it", key)
    if not has_units:
        return CompileChoice(False, "the model declares no block units (ac_units) to compile", key)
    cost, saving, how = compile_pays(steps, read_record(key), est_step_s)
    if saving > cost:
        return CompileChoice(True, how, key, cost, saving)
    return CompileChoice(False, f"{how}; parallel.compile=true forces it", key, cost, saving)


def kernel_choices(device_type: str) -> dict[str, str]:
    """Op -> the implementation the kernel registry dispatches host/device tensors of ``device_type`` to
    (the highest-priority registered kernel of the active backend, else ``reference``)."""
    from crosstrain.kernels import registry

    if registry.mode == "reference":
        return {op: "reference" for op in sorted(registry.ops())}
    out: dict[str, str] = {}
    for op in sorted(registry.ops()):
        impls = [i for i in registry.impls(op) if i.device_type == device_type
                 and (registry.active_backend is None or i.backend == registry.active_backend)]
        out[op] = (impls[0].label or impls[0].backend) if impls else "reference"
    return out
