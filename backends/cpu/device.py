"""The CPU device: process memory from /proc, GEMM peak measured once and cached."""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from pathlib import Path

import torch

from crosstrain.device import Availability, Device, MemoryStats

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss() -> int:
    """Resident set size of this process in bytes."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except OSError:
        return peak_rss()


def peak_rss() -> int:
    """Peak resident set size since start or the last reset, in bytes."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    scale = 1 if platform.system() == "Darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "crosstrain" / "cpu_peak_flops.json"


def measure_gemm_flops(dtype: torch.dtype, n: int = 512, seconds: float = 0.3) -> float:
    """Best observed FLOP/s of an ``n x n`` matmul in ``dtype`` on this process's threads."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        dt = time.perf_counter() - t0
        best = max(best, 4 * 2 * n**3 / dt)
    return best


class CpuDevice(Device):
    """The host CPU as a training device (gloo collectives)."""

    type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None

    def __init__(self) -> None:
        self._peaks: dict[str, float] = {}

    def availability(self) -> Availability:
        return Availability(True, "")

    def device_count(self) -> int:
        return 1

    def device_for_local_rank(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device: torch.device | int) -> None:
        return None

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        return None

    def memory_stats(self) -> MemoryStats:
        rss = current_rss()
        return MemoryStats(allocated=rss, reserved=rss, peak=max(peak_rss(), rss), total=total_memory())

    def reset_peak_memory_stats(self) -> None:
        # Linux: writing 5 to clear_refs resets VmHWM to the current RSS.
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:
            pass

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        return frozenset({torch.float32, torch.bfloat16, torch.float16})

    def autocast_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Measured GEMM FLOP/s for ``dtype`` with the current thread count, cached on disk per host."""
        override = os.environ.get("CROSSTRAIN_PEAK_FLOPS")
        if override:
            return float(override)
        key = f"{platform.machine()}-{platform.node()}-{torch.get_num_threads()}t-{dtype}".replace("torch.", "")
        if key in self._peaks:
            return self._peaks[key]
        path = _cache_file()
        cache: dict[str, float] = {}
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        if key not in cache:
            cache[key] = measure_gemm_flops(dtype)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
                os.replace(tmp, path)
            except OSError:
                pass
        self._peaks[key] = float(cache[key])
        return self._peaks[key]
