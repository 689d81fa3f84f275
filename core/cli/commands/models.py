"""``crosstrain models``: every model family (the registry of :mod:`crosstrain.models.family`, plugins' included),
its path (native or generic), the Hugging Face model_types it takes, what it refuses and the parallel dims it
admits. Everything shown comes from the family bundles, so a plugin's family appears without changes here."""

from __future__ import annotations

import argparse
import json
from typing import Any


def _generic_types(native: set[str]) -> list[str]:
    """transformers' decoder-only causal-LM model_types no native family imports (encoders and encoder-decoders
    left out: the generic path refuses them); empty without transformers."""
    try:
        from crosstrain.models.generic.decoder import decoder_only_types

        return sorted(decoder_only_types() - native)
    except ImportError:
        return []


def collect() -> dict[str, Any]:
    from crosstrain.models.family import extensions, families, native_model_types

    native = native_model_types()
    out = []
    for fam in families().values():
        dims = list(fam.parallel_dims)
        for ext in extensions(fam.name):
            dims += [d for d in ext.parallel_dims if d not in dims]
        types = sorted(mt for mt, name in native.items() if name == fam.name) if fam.path == "native" \
            else _generic_types(set(native))
        out.append({"family": fam.name, "path": fam.path, "presets": sorted(fam.presets), "model_types": types,
                    "refuses": list(fam.refuses), "parallel_dims": dims,
                    "extensions": [ext.name for ext in extensions(fam.name)]})
    return {"families": out}


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for fam in data["families"]:
        types = fam["model_types"]
        if fam["path"] == "generic":
            shown = f"every other decoder-only causal LM ({len(types)} model_types in this transformers)"
        else:
            shown = ", ".join(fam["presets"] + types)
        print(f"{fam['family']} ({fam['path']}): {shown}")
        print(f"  parallel dims: {', '.join(fam['parallel_dims'])}")
        print(f"  refuses: {'; '.join(fam['refuses']) or '-'}")
    print("model.source='auto' takes the native family of a model.init_from model_type, else generic")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list model families: native or generic path, refusals, parallel dims")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
