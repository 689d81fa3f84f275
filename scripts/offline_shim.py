"""Make crosstrain importable from a source tree without installing or building anything (a GPU machine with no
network): a temporary folder maps core/ -> crosstrain (backends/, plugins/ inside it) and carries the entry points
from pyproject.toml. Prints the folder; put it first on PYTHONPATH. The CPU backend's native kernels are not built,
so the CPU runs use the reference kernels.

    export PYTHONPATH="$(python3 scripts/offline_shim.py REPO)${PYTHONPATH:+:$PYTHONPATH}"
"""

from __future__ import annotations

import os
import sys
import tempfile

import tomllib  # Python >= 3.11, as on the GPU image


def make_shim(repo: str) -> str:
    """A new folder holding ``crosstrain`` (links into ``repo``) and a dist-info with its entry points."""
    shim = tempfile.mkdtemp(prefix="crosstrain_shim_")
    pkg = os.path.join(shim, "crosstrain")
    os.makedirs(pkg)
    for entry in os.listdir(os.path.join(repo, "core")):
        os.symlink(os.path.join(repo, "core", entry), os.path.join(pkg, entry))
    for sub in ("backends", "plugins"):
        if os.path.isdir(os.path.join(repo, sub)):
            os.symlink(os.path.join(repo, sub), os.path.join(pkg, sub))
    with open(os.path.join(repo, "pyproject.toml"), "rb") as fh:
        meta = tomllib.load(fh)["project"]
    info = os.path.join(shim, f"crosstrain-{meta['version']}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: crosstrain\nVersion: {meta['version']}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as fh:
        for group, eps in meta.get("entry-points", {}).items():
            fh.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n")
    return shim


if __name__ == "__main__":
    print(make_shim(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
