"""The CPU's peak FLOP/s for MFU: measured, cached per CPU, and corrected when the cache is wrong.

What is measured is what a run does: ``F.linear`` (the model's matmuls; a plain bf16 ``matmul`` takes a much
slower path on CPUs without AVX-512 BF16) of a 1024x1024 activation by a 1024x1024 weight, in the run's dtype
and on the run's thread count, best of several trials (a busy machine only ever makes a trial slower). The cache
(``cpu_peak_flops.json`` in the user's cache directory) is keyed by CPU model, ISA, thread count and dtype. A figure
measured under load is too low and would make every later MFU too high, so each process times one more trial
first and measures again when that trial beats the cached figure by more than :data:`RECHECK_MARGIN`.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from crosstrain.checkpoint.atomic import atomic_write
from crosstrain.checkpoint.space import NoSpaceError

N = 1024
TRIALS = 5
MAX_SECONDS = 2.0  # per measurement: a dtype with a very slow path gets fewer trials, never fewer than one
RECHECK_MARGIN = 1.25
CACHE_VERSION = 2
ENV_OVERRIDE = "CROSSTRAIN_PEAK_FLOPS"


@dataclass(frozen=True)
class Peak:
    """A peak figure and where it came from (summary.json records both)."""

    flops: float
    source: str


def cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "crosstrain" / "cpu_peak_flops.json"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa() -> str:
    """The vector ISA torch dispatches to (``AVX2``, ``AVX512``, ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older torch
        return platform.machine()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def key(dtype: torch.dtype, threads: int) -> str:
    return f"{cpu_model()} | {isa()} | {threads} thread(s) | {dtype_name(dtype)}"


def measure(dtype: torch.dtype, trials: int = TRIALS, max_seconds: float = MAX_SECONDS) -> float:
    """Best FLOP/s of ``F.linear`` on N x N in ``dtype`` over ``trials`` (fewer if ``max_seconds`` runs out)."""
    gen = torch.Generator().manual_seed(0)  # never the global RNG: measuring must not change what a run trains
    x = torch.randn(N, N, generator=gen).to(dtype)
    w = torch.randn(N, N, generator=gen).to(dtype)
    F.linear(x, w)  # warm-up: first-call dispatch and allocation
    best, deadline = 0.0, time.perf_counter() + max_seconds
    for _ in range(trials):
        t0 = time.perf_counter()
        F.linear(x, w)
        best = max(best, 2 * N**3 / (time.perf_counter() - t0))
        if time.perf_counter() > deadline:
            break
    return best


def _read_cache(path: Path) -> dict[str, dict[str, float]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("peaks"), dict):
        return {}  # an older format (it timed torch.mm, keyed by host name): measure again
    return data["peaks"]


def _write_cache(path: Path, peaks: dict[str, dict[str, float]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"version": CACHE_VERSION, "peaks": peaks}, indent=1, sort_keys=True) + "\n")
    except (OSError, NoSpaceError):
        pass  # a read-only or full home: the figure is still measured, just not kept


def _plausible(entry: object) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0


def peak(dtype: torch.dtype, *, remeasure: bool = False) -> Peak:
    """The peak FLOP/s for ``dtype`` on this process's thread count: the override, the cache or a measurement."""
    from crosstrain.backends.cuda.specs import peak_override  # the same syntax for every backend (pure parsing)

    override = peak_override(dtype)
    if override is not None:
        return Peak(override, f"${ENV_OVERRIDE}")
    threads = torch.get_num_threads()
    name, path = key(dtype, threads), cache_file()
    peaks = _read_cache(path)
    entry = peaks.get(name)
    how = f"F.linear {N}x{N} {dtype_name(dtype)}, {threads} thread(s), {isa()}"
    if _plausible(entry) and not remeasure:
        assert isinstance(entry, dict)
        check = measure(dtype, trials=1)
        if check <= RECHECK_MARGIN * entry["flops"]:
            return Peak(float(entry["flops"]), f"cached measurement ({how}) in {path}")
    flops = measure(dtype)
    if _plausible(entry) and not remeasure:
        assert isinstance(entry, dict)
        flops = max(flops, float(entry["flops"]))
    peaks[name] = {"flops": flops, "measured_unix": time.time(), "load_1min": _load()}
    _write_cache(path, peaks)
    return Peak(flops, f"measured now ({how}, best of {TRIALS}); cached in {path}")


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return -1.0
