"""How fast the CLI answers: ``crosstrain --help``, ``--version`` and ``train --help`` against
``python -c "import torch"``, each a fresh interpreter, side by side in one run.

The commands run in interleaved rounds (ABBA, :func:`_timing.alternate`), so a change in the machine's load hits
all of them alike; each figure is the median wall time of its rounds, and ``<name>_vs_torch`` = that median / the
median of ``import torch`` (issue 41's target: <= 0.3). ``config_show`` (``crosstrain config show --json``, which
validates every section, plugins' included) is timed beside them for the record.

Last line: JSON ``{"rounds", "median_s": {...}, "help_vs_torch", "version_vs_torch", "train_help_vs_torch",
"config_show_vs_torch", "load_1min"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _timing import alternate

COMMANDS = {
    "import_torch": [sys.executable, "-c", "import torch"],
    "help": [sys.executable, "-m", "crosstrain", "--help"],
    "version": [sys.executable, "-m", "crosstrain", "--version"],
    "train_help": [sys.executable, "-m", "crosstrain", "train", "--help"],
    "config_show": [sys.executable, "-m", "crosstrain", "config", "show", "--json"],
}


def wall(name: str, _round: int) -> float:
    t0 = time.perf_counter()
    subprocess.run(COMMANDS[name], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved repeats of every command")
    args = parser.parse_args()
    wall("import_torch", -1)  # warm the page cache once, so no command pays for the first read of torch's files
    results = alternate(list(COMMANDS), args.rounds, wall)
    medians = {name: statistics.median(times) for name, times in results.items()}
    for name, times in results.items():
        print(f"{name:13s} median {medians[name]:.3f} s  (min {min(times):.3f}, max {max(times):.3f})")
    torch_s = medians["import_torch"]
    out = {"rounds": args.rounds, "median_s": {k: round(v, 4) for k, v in medians.items()},
           **{f"{k}_vs_torch": round(v / torch_s, 3) for k, v in medians.items() if k != "import_torch"},
           "load_1min": round(os.getloadavg()[0], 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
