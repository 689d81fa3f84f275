"""Published peak figures of accelerator parts, matched by device name, plus the fallbacks.

Peaks are dense (no sparsity) FLOP/s per device. ``fp32`` is the plain FP32 rate (CUDA cores on NVIDIA, so
TF32 matmuls can exceed it; matrix cores on AMD). ``CROSSTRAIN_PEAK_FLOPS`` overrides the table: a single number
for every dtype (``9.89e14``) or per dtype (``bf16=9.89e14,fp32=6.7e13``). For a part the table does not know,
:func:`measure_matmul_flops` measures the best matmul rate once per process (logged), so MFU stays defined.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from crosstrain.errors import ConfigError

log = logging.getLogger("crosstrain.backends")

ENV_PEAK_FLOPS = "CROSSTRAIN_PEAK_FLOPS"

DTYPE_KEYS: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}


@dataclass(frozen=True)
class PartSpec:
    """One accelerator part: a regex on the device name, peaks by dtype key, HBM bandwidth in bytes/s."""

    name: str
    pattern: str
    flops: dict[str, float] = field(default_factory=dict)
    bandwidth: float = 0.0

    def matches(self, device_name: str) -> bool:
        return re.search(self.pattern, device_name, flags=re.IGNORECASE) is not None


def peaks(bf16: float, fp32: float, fp8: float = 0.0, fp16: float | None = None) -> dict[str, float]:
    out = {"bf16": bf16, "fp16": bf16 if fp16 is None else fp16, "fp32": fp32}
    if fp8:
        out["fp8"] = fp8
    return out


T = 1e12
#: NVIDIA parts, most specific pattern first (NVIDIA datasheets, dense figures).
NVIDIA_PARTS: tuple[PartSpec, ...] = (
    PartSpec("B200", r"\bB200\b", peaks(2250 * T, 80 * T, 4500 * T), 8.0e12),
    PartSpec("H200 NVL", r"H200.*NVL", peaks(835.6 * T, 60 * T, 1671 * T), 4.8e12),
    PartSpec("H200", r"\bH200\b", peaks(989.4 * T, 66.9 * T, 1978.9 * T), 4.8e12),
    PartSpec("H100 NVL", r"H100.*NVL", peaks(835.6 * T, 60 * T, 1671 * T), 3.9e12),
    PartSpec("H100 PCIe", r"H100.*PCIe", peaks(756.5 * T, 51.2 * T, 1513 * T), 2.0e12),
    PartSpec("H100 SXM", r"\bH100\b", peaks(989.4 * T, 66.9 * T, 1978.9 * T), 3.35e12),
    PartSpec("A100 80GB", r"A100.*80\s*GB", peaks(312 * T, 19.5 * T), 2.0e12),
    PartSpec("A100 40GB", r"\bA100\b", peaks(312 * T, 19.5 * T), 1.555e12),
    PartSpec("L40S", r"\bL40S\b", peaks(362.05 * T, 91.6 * T, 733 * T), 0.864e12),
    PartSpec("RTX 4090", r"RTX\s*4090", peaks(165.2 * T, 82.6 * T, 330.3 * T), 1.008e12),
)


def find_part(device_name: str, parts: tuple[PartSpec, ...]) -> PartSpec | None:
    for part in parts:
        if part.matches(device_name):
            return part
    return None


def peak_override(dtype: torch.dtype) -> float | None:
    """The ``CROSSTRAIN_PEAK_FLOPS`` value for ``dtype``, None when unset (or not given for this dtype)."""
    raw = os.environ.get(ENV_PEAK_FLOPS, "").strip()
    if not raw:
        return None
    key = DTYPE_KEYS.get(dtype, str(dtype))
    try:
        if "=" not in raw:
            return float(raw)
        values = {}
        for item in raw.split(","):
            k, v = item.split("=", 1)
            values[k.strip()] = float(v)
    except ValueError:
        raise ConfigError(
            f"{ENV_PEAK_FLOPS}={raw!r} is not a number or a list like 'bf16=9.89e14,fp32=6.7e13'; fix or unset it"
        ) from None
    return values.get(key)


_measured: dict[tuple[str, str], float] = {}


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 4096, iters: int = 10) -> float:
    """Best observed dense matmul FLOP/s on ``device`` (cached per process); fallback for unknown parts."""
    key = (str(device), str(dtype))
    if key not in _measured:
        mod = torch.get_device_module(device.type)
        mm_dtype = torch.bfloat16 if DTYPE_KEYS.get(dtype) == "fp8" else dtype
        a = torch.randn(n, n, device=device).to(mm_dtype)
        b = torch.randn(n, n, device=device).to(mm_dtype)
        torch.mm(a, b)
        mod.synchronize()
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(iters):
                torch.mm(a, b)
            mod.synchronize()
            best = max(best, iters * 2 * n**3 / (time.perf_counter() - t0))
        _measured[key] = best
        log.warning(
            "peak FLOP/s of %s for %s is not in crosstrain's table; using a measured %.3g FLOP/s "
            "(set %s to override)", device, dtype, best, ENV_PEAK_FLOPS,
        )
    return _measured[key]


def table_peak(device_name: str, dtype: torch.dtype, parts: tuple[PartSpec, ...]) -> float | None:
    """Peak for ``dtype`` from the table; 0.0 when the part lacks that dtype (e.g. fp8 on A100); None if unknown."""
    part = find_part(device_name, parts)
    if part is None:
        return None
    return part.flops.get(DTYPE_KEYS.get(dtype, ""), 0.0)


def resolve_peak_flops(device_name: str, dtype: torch.dtype, parts: tuple[PartSpec, ...],
                       device: Callable[[], torch.device], *, measure_unlisted_dtype: bool = False) -> float:
    """Peak FLOP/s for MFU: ``CROSSTRAIN_PEAK_FLOPS``, else the parts table by name, else a measured matmul rate.

    A known part without a figure for ``dtype`` gives 0.0 (the part lacks it), or, with
    ``measure_unlisted_dtype``, the measured rate (the vendor publishes no figure for it). ``device`` is called
    only when a measurement is needed.
    """
    override = peak_override(dtype)
    if override is not None:
        return override
    peak = table_peak(device_name, dtype, parts)
    if peak or (peak is not None and not measure_unlisted_dtype):
        return peak
    return measure_matmul_flops(device(), dtype)
