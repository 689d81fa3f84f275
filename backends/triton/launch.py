"""Per-vendor launch configs and autotuning for the shared Triton kernels.

Configs are written in *threads per program*; ``num_warps`` is derived from the vendor's SIMD width:
a warp is 32 threads on NVIDIA, a wavefront is 64 on AMD (``torch.version.hip`` set). So the same thread
budget gives half as many warps on AMD, which keeps occupancy sane on CDNA parts.

Under ``TRITON_INTERPRET=1`` (CPU tests) there is no device to time configs on, so the first config of each
list is used without autotuning.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "yes", "on"}


def vendor() -> str:
    """``"amd"`` on a ROCm build of torch, else ``"nvidia"``."""
    return "amd" if getattr(torch.version, "hip", None) else "nvidia"


def warp_size() -> int:
    return 64 if vendor() == "amd" else 32


def make_configs(threads: Sequence[int], meta: Sequence[dict[str, Any]] = ({},)) -> list[triton.Config]:
    """Cross product of thread budgets and constexpr dicts, as ``triton.Config`` for this vendor."""
    ws = warp_size()
    out: list[triton.Config] = []
    seen: set[tuple] = set()
    for kwargs in meta:
        for t in threads:
            warps = max(1, t // ws)
            key = (tuple(sorted(kwargs.items())), warps)
            if key in seen:
                continue
            seen.add(key)
            # AMD: one software-pipelining stage suits these streaming kernels; NVIDIA keeps triton's default.
            stages = 1 if ws == 64 else 2
            out.append(triton.Config(dict(kwargs), num_warps=warps, num_stages=stages))
    return out


class Launcher:
    """``launcher[grid](*args, **kwargs)`` runs ``fn`` autotuned over per-vendor configs (built on first use).

    ``configs`` is a callable returning the config list (so the vendor is read at launch time, not import);
    ``tune=False`` uses the first config only (for kernels that write in place, where autotuning's repeated
    runs would corrupt results).
    """

    def __init__(self, fn: Any, configs: Callable[[], list[triton.Config]], key: list[str], tune: bool = True):
        self.fn = fn
        self.configs = configs
        self.key = key
        self.tune = tune
        self._tuned: Any = None

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        if interpreting() or not self.tune:
            cfg = self.configs()[0]

            def run(*args: Any, **kwargs: Any) -> Any:
                meta = {**kwargs, **cfg.kwargs}
                g = grid(meta) if callable(grid) else grid
                if interpreting():
                    return self.fn[g](*args, **meta)
                return self.fn[g](*args, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

            return run
        if self._tuned is None:
            self._tuned = triton.autotune(configs=self.configs(), key=self.key)(self.fn)
        return self._tuned[grid]


def num_programs(device: torch.device, per_sm: int = 4) -> int:
    """A persistent grid size: a few programs per streaming multiprocessor / compute unit."""
    if device.type == "cuda" and not interpreting():
        props = torch.cuda.get_device_properties(device)
        return int(props.multi_processor_count) * per_sm
    return 4
