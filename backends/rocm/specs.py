"""AMD Instinct parts (AMD datasheets, dense figures; ``fp32`` is the matrix-core FP32 rate)."""

from __future__ import annotations

from crosstrain.backends.cuda.specs import PartSpec, peaks

T = 1e12
AMD_PARTS: tuple[PartSpec, ...] = (
    PartSpec("MI325X", r"MI325X", peaks(1307.4 * T, 163.4 * T, 2614.9 * T), 6.0e12),
    PartSpec("MI300X", r"MI300X", peaks(1307.4 * T, 163.4 * T, 2614.9 * T), 5.3e12),
    PartSpec("MI250X", r"MI250X?\b", peaks(383 * T, 95.7 * T), 3.2768e12),
)

#: gfx architectures with hardware fp8 matmuls (CDNA3 and newer).
FP8_ARCHS = ("gfx942", "gfx950")
