"""The config checked against what the active backend declares it can do, before anything is built."""

from __future__ import annotations

from crosstrain.backend import Backend
from crosstrain.config.schema import Config
from crosstrain.errors import ConfigError

#: ``precision.dtype`` values that need a capability of the backend (fp32 needs none).
PRECISION_NEEDS = {"bf16": "bf16", "fp16": "fp16"}


def check_capabilities(backend: Backend, config: Config) -> None:
    """Raise a one-line :class:`ConfigError` when ``config`` asks for something ``backend`` does not declare.

    Call it once the backend's device exists: GPU backends refine ``capabilities`` from the visible part
    (bf16 is dropped before Ampere), and only the refined set says what this machine can run.
    """
    dtype = config.precision.dtype
    needed = PRECISION_NEEDS.get(dtype)
    if needed is None or backend.has(needed):
        return
    usable = ["fp32", *(d for d, cap in PRECISION_NEEDS.items() if backend.has(cap))]
    raise ConfigError(f"precision.dtype={dtype!r} needs the {needed!r} capability, which backend {backend.name!r} "
                      f"does not declare; use precision.dtype one of {', '.join(repr(d) for d in usable)}")
