"""``crosstrain backends``: every discovered backend, whether it is usable here, and why not."""

from __future__ import annotations

import argparse
import json
from typing import Any


def collect() -> dict[str, Any]:
    # probing a backend needs torch (its device counts, its kernels): imported here, not when the CLI starts
    from crosstrain import pluginmanager, registry
    from crosstrain.kernels import registry as kernel_registry

    backends = []
    impls_by_backend: dict[str, list[str]] = {}
    for op in kernel_registry.ops():
        for impl in kernel_registry.impls(op):
            impls_by_backend.setdefault(impl.backend, []).append(op)
    for name, backend in sorted(registry.backends().items(), key=lambda kv: (-kv[1].priority, kv[0])):
        info = backend.describe()
        info["kernels"] = sorted(set(impls_by_backend.get(name, [])))
        backends.append(info)
    errors = [{"plugin": e.name, "error": e.error} for e in pluginmanager.load_errors()]
    return {"backends": backends, "plugin_errors": errors}


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="crosstrain backends")
    for col in ("backend", "available", "devices", "collective", "capabilities", "kernels", "reason"):
        table.add_column(col)
    for b in data["backends"]:
        table.add_row(b["name"], "yes" if b["available"] else "no", str(b.get("device_count", 0)),
                      b.get("dist_backend", ""), ", ".join(b["capabilities"]), ", ".join(b["kernels"]) or "reference",
                      b["reason"])
    console = Console()
    console.print(table)
    for e in data["plugin_errors"]:
        console.print(f"[red]plugin {e['plugin']} failed:[/red] {e['error']}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("backends", help="list backends, their availability and kernels")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
