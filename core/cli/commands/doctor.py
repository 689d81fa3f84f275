"""``crosstrain doctor``: versions, detected hardware and the environment variables that matter."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
from typing import Any

from crosstrain import __version__, pluginmanager, registry

PACKAGES = ("torch", "triton", "torch-npu", "onnx", "onnxruntime", "onnxscript", "pluggy", "pydantic", "rich",
            "safetensors", "numpy")
ENV_VARS = ("CROSSTRAIN_BACKEND", "CROSSTRAIN_KERNELS", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
            "ROCR_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "OMP_NUM_THREADS",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TRITON_INTERPRET")


def collect() -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    import torch

    hardware = {name: {k: b[k] for k in ("available", "reason", "device_count")}
                for name, b in ((n, be.describe()) for n, be in registry.backends().items())}
    return {
        "crosstrain": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_build": {"cuda": torch.version.__dict__.get("cuda"), "hip": torch.version.__dict__.get("hip")},
        "packages": versions,
        "backends": hardware,
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
        "plugin_errors": [{"plugin": e.name, "error": e.error} for e in pluginmanager.load_errors()],
    }


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.console import Console

    console = Console()
    console.print(f"[bold]crosstrain {data['crosstrain']}[/bold] on Python {data['python']} ({data['platform']})")
    console.print(f"CPUs: {data['cpu_count']}, torch threads: {data['torch_threads']}, "
                  f"torch build: {data['torch_build']}")
    for pkg, ver in data["packages"].items():
        console.print(f"  {pkg:12s} {ver or '-'}")
    for name, info in data["backends"].items():
        if info["available"]:
            state = f"available, {info['device_count']} device(s)"
        else:
            state = f"unavailable: {info['reason']}"
        console.print(f"backend {name}: {state}")
    for k, v in data["env"].items():
        console.print(f"  {k}={v}")
    for e in data["plugin_errors"]:
        console.print(f"[red]plugin {e['plugin']} failed:[/red] {e['error']}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="versions, hardware and environment")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
