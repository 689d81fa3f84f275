"""``crosstrain doctor``: versions, detected hardware and the environment variables that matter.

Device packages and variables (a GPU toolkit, its visibility variable) come from each backend's
``doctor_lines()``, so a third-party backend shows its own and the core names none.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from typing import TYPE_CHECKING, Any

from crosstrain import __version__

if TYPE_CHECKING:
    from crosstrain.backend import Backend

PACKAGES = ("torch", "onnx", "onnxruntime", "onnxscript", "pluggy", "pydantic", "rich", "safetensors", "numpy")
ENV_VARS = ("CROSSTRAIN_BACKEND", "CROSSTRAIN_KERNELS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
            "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "OMP_NUM_THREADS")


def _backend_info(backend: Backend) -> dict[str, Any]:
    described = backend.describe()
    info = {k: described[k] for k in ("available", "reason", "device_count")}
    try:
        info["details"] = dict(backend.doctor_lines())
    except Exception as exc:  # a backend's diagnostics must not break the report of the others
        info["details"] = {"doctor_lines() failed": f"{type(exc).__name__}: {exc}"}
    return info


def collect() -> dict[str, Any]:
    import torch

    from crosstrain import pluginmanager, registry
    from crosstrain.diagnostics import package_version

    return {
        "crosstrain": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "packages": {pkg: package_version(pkg) for pkg in PACKAGES},
        "backends": {name: _backend_info(b) for name, b in registry.backends().items()},
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
        "plugin_errors": [{"plugin": e.name, "error": e.error} for e in pluginmanager.load_errors()],
    }


def measure_peaks() -> dict[str, dict[str, dict[str, Any]]]:
    """Every available backend's peak FLOP/s per dtype, measured again now (cached figures are replaced)."""
    import torch

    from crosstrain import registry

    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, backend in registry.backends().items():
        if not backend.availability():
            continue
        device = backend.device()
        device.remeasure_peak_flops()
        out[name] = {}
        for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            try:
                out[name][label] = {"flops": device.peak_flops(dtype), "source": device.peak_flops_source(dtype)}
            except Exception as exc:  # one backend's probe must not hide the others
                out[name][label] = {"flops": 0.0, "source": f"failed: {type(exc).__name__}: {exc}"}
    return out


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.measure:
        data["peak_flops"] = measure_peaks()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.console import Console

    console = Console()
    console.print(f"[bold]crosstrain {data['crosstrain']}[/bold] on Python {data['python']} ({data['platform']})")
    console.print(f"CPUs: {data['cpu_count']}, torch threads: {data['torch_threads']}")
    for pkg, ver in data["packages"].items():
        console.print(f"  {pkg:12s} {ver or '-'}")
    for name, info in data["backends"].items():
        if info["available"]:
            state = f"available, {info['device_count']} device(s)"
        else:
            state = f"unavailable: {info['reason']}"
        console.print(f"backend {name}: {state}")
        for label, value in info["details"].items():
            console.print(f"  {label}: {value}")
    for k, v in data["env"].items():
        console.print(f"  {k}={v}")
    for e in data["plugin_errors"]:
        console.print(f"[red]plugin {e['plugin']} failed:[/red] {e['error']}")
    for name, peaks in data.get("peak_flops", {}).items():
        console.print(f"peak FLOP/s of backend {name} (torch threads: {data['torch_threads']}):", highlight=False)
        for label, entry in peaks.items():
            console.print(f"  {label}: {entry['flops'] / 1e9:,.1f} GFLOP/s  ({entry['source']})", highlight=False)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="versions, hardware and environment")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--measure", action="store_true",
                   help="measure each available backend's peak FLOP/s now (the figure MFU divides by) and cache it")
    p.set_defaults(func=run)
