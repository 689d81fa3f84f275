"""A test plugin (tests/test_observability.py): rank ``CROSSTRAIN_SLOW_RANK`` sleeps ``CROSSTRAIN_SLOW_S`` seconds
at the end of every step from step 2 on, as a straggler would. Found through its entry point when this folder is
on PYTHONPATH (the dist-info next to it), in every ``--nproc`` worker."""

from __future__ import annotations

import os
import time
from typing import Any

from crosstrain import hookimpl


@hookimpl
def crosstrain_on_step_end(context: Any, step: int, metrics: dict[str, float]) -> None:
    slow = os.environ.get("CROSSTRAIN_SLOW_RANK")
    if slow is not None and context.rank == int(slow) and step >= 2:
        time.sleep(float(os.environ.get("CROSSTRAIN_SLOW_S", "0.2")))
