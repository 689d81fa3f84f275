"""What the simdev extension costs: a build into an empty cache (what a fresh CI machine pays once) and a load
from the warm cache (what every later process pays), each in a fresh interpreter.

Last line: JSON ``{"cold_build_s", "warm_load_s", "cpus", "load_1min"}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

LOAD = "from crosstrain.backends.simdev import runtime; runtime.extension()"


def _timed(env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", LOAD], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "CROSSTRAIN_SIMDEV_CACHE": cache}
        cold = _timed(env)
        warm = _timed(env)
    result = {"cold_build_s": round(cold, 1), "warm_load_s": round(warm, 2), "cpus": os.cpu_count(),
              "load_1min": round(os.getloadavg()[0], 2)}
    print(f"simdev extension: {cold:.1f} s to build into an empty cache, {warm:.2f} s to load from it")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
