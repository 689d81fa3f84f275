"""Triton kernels shared by the cuda and rocm backends (one source, per-vendor launch configs).

Importing this package does not import triton: :mod:`crosstrain.backends.triton.register` registers lazy
wrappers, and the kernel modules (``rms_norm``, ``rotary``, ``swiglu``, ``cross_entropy``) import triton on
first use. Kernels run on the CPU under ``TRITON_INTERPRET=1`` (how CI tests them).
"""

from __future__ import annotations

import importlib.util


def triton_installed() -> bool:
    """True when the ``triton`` package can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False
