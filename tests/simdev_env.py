"""What the tests that compare simdev with the cpu backend share: whether simdev runs here (``needs_simdev``, their
module's skip mark) and ``crosstrain`` started as its own process on a chosen backend."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from crosstrain import registry


def _problem() -> str | None:
    if sys.platform != "linux":
        return "simdev's device memory is Linux memfd mappings"
    avail = registry.get_backend("simdev").availability()
    return None if avail else f"simdev cannot be built here: {avail.reason}"


PROBLEM = _problem()
#: ``pytestmark = needs_simdev``: skip the module, saying why, where simdev cannot run
needs_simdev = pytest.mark.skipif(PROBLEM is not None, reason=str(PROBLEM))


def crosstrain_on(backend: str, argv: list[str]) -> subprocess.Popen[str]:
    """``python -m crosstrain ARGV`` on ``backend`` (one thread, unbuffered, none of this process's rank variables),
    its stdout and stderr piped."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(CROSSTRAIN_BACKEND=backend, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "crosstrain", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
