"""The AMD ROCm backend: torch's ROCm build (device type ``cuda``), RCCL via ``nccl``, the shared Triton kernels."""
