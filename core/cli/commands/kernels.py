"""``crosstrain kernels``: every declared op, its signature and the implementations registered for it."""

from __future__ import annotations

import argparse
import json
from typing import Any


def collect() -> dict[str, Any]:
    from crosstrain.kernels import registry  # imports torch: only when the command runs

    ops = []
    for name, spec in sorted(registry.ops().items()):
        ops.append({
            "op": name,
            "signature": f"{name}{spec.signature}",
            "doc": spec.doc,
            "implementations": [
                {"backend": i.backend, "device_type": i.device_type, "priority": i.priority, "label": i.label}
                for i in registry.impls(name)
            ],
        })
    return {"mode": registry.mode, "ops": ops}


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"crosstrain kernels (mode: {data['mode']})")
    table.add_column("op and signature")
    table.add_column("implementations (backend/device: label, priority)")
    table.add_column("description")
    for op in data["ops"]:
        impls = ", ".join(f"{i['backend']}/{i['device_type']}: {i['label']} ({i['priority']})"
                          for i in op["implementations"])
        table.add_row(op["signature"], impls or "reference only", op["doc"])
    Console().print(table)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernels", help="list kernel ops and their implementations")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
