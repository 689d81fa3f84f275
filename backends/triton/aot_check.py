"""Compile every shared Triton kernel ahead of time for NVIDIA and AMD targets; no GPU needed.

``python -m crosstrain.backends.triton.aot_check`` lowers each kernel through triton's real compiler to a cubin
(sm_90) and an hsaco (gfx942, wavefront 64), catching what the CPU interpreter cannot: compiled-mode typing,
control flow and layout errors. It proves the kernels build, not that they are fast or run on a device.
Must run without ``TRITON_INTERPRET`` (the interpreter replaces the compiler).
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: kernel -> (module, argument types, constexpr values), the types used by a bf16 training step.
KERNELS: dict[str, tuple[str, dict[str, str], dict[str, int]]] = {
    "_rms_fwd": ("rms_norm", {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "RSTD": "*fp32", "stride": "i32",
                              "N": "i32", "eps": "fp32", "BLOCK_N": "constexpr"}, {"BLOCK_N": 4096}),
    "_rms_bwd": ("rms_norm", {"DY": "*bf16", "X": "*bf16", "W": "*bf16", "RSTD": "*fp32", "DX": "*bf16",
                              "DW_PART": "*fp32", "stride": "i32", "M": "i32", "N": "i32", "rows_per_program": "i32",
                              "BLOCK_N": "constexpr"}, {"BLOCK_N": 4096}),
    "_swiglu_fwd": ("swiglu", {"G": "*bf16", "U": "*bf16", "Y": "*bf16", "n": "i64", "BLOCK": "constexpr"},
                    {"BLOCK": 1024}),
    "_swiglu_bwd": ("swiglu", {"DY": "*bf16", "G": "*bf16", "U": "*bf16", "DG": "*bf16", "DU": "*bf16", "n": "i32",
                               "BLOCK": "constexpr"}, {"BLOCK": 2048}),
    "_rotary": ("rotary", {"X": "*bf16", "COS": "*fp32", "SIN": "*fp32", "Y": "*bf16", "T": "i32", "H": "i32",
                           "HALF": "i32", "sign": "fp32", "BLOCK_H": "constexpr", "BLOCK_D": "constexpr"},
                {"BLOCK_H": 32, "BLOCK_D": 64}),
    "_ce_fwd": ("cross_entropy", {"X": "*bf16", "TGT": "*i64", "LOSS": "*fp32", "LSE": "*fp32", "stride": "i32",
                                  "V": "i32", "ignore_index": "i32", "BLOCK": "constexpr"}, {"BLOCK": 4096}),
    "_ce_bwd": ("cross_entropy", {"X": "*bf16", "TGT": "*i64", "LSE": "*fp32", "DX": "*bf16", "SCALE": "*fp32",
                                  "stride": "i32", "dstride": "i32", "V": "i32", "ignore_index": "i32",
                                  "BLOCK": "constexpr"}, {"BLOCK": 4096}),
    "_grouped_mm_kernel": ("grouped_mm", {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "tile_group": "*i64",
                                          "tile_start": "*i64", "tile_end": "*i64", "K": "i32", "M": "i32",
                                          "sxm": "i32", "sxk": "i32", "swg": "i32", "swk": "i32", "swn": "i32",
                                          "sym": "i32", "syn": "i32", "IEEE": "constexpr", "BM": "constexpr",
                                          "BN": "constexpr", "BK": "constexpr"},
                           {"IEEE": 0, "BM": 32, "BN": 32, "BK": 32}),
    "_grouped_wgrad_kernel": ("grouped_mm", {"X": "*bf16", "DY": "*bf16", "DW": "*bf16", "offsets": "*i64",
                                             "K": "i32", "M": "i32", "sxm": "i32", "sxk": "i32", "sym": "i32",
                                             "syn": "i32", "swg": "i32", "swk": "i32", "swn": "i32",
                                             "IEEE": "constexpr", "BM": "constexpr", "BN": "constexpr",
                                             "BK": "constexpr"}, {"IEEE": 0, "BM": 32, "BN": 32, "BK": 32}),
    "_gather_rows": ("moe_permute", {"X": "*bf16", "src": "*i64", "scale": "*bf16", "Y": "*bf16", "D": "i32",
                                     "sx": "i32", "sy": "i32", "HAS_SCALE": "constexpr", "BLOCK": "constexpr"},
                     {"HAS_SCALE": 1, "BLOCK": 128}),
    "_gather_sum": ("moe_permute", {"X": "*bf16", "idx": "*i64", "w": "*bf16", "Y": "*bf16", "D": "i32", "K": "i32",
                                    "sx": "i32", "sy": "i32", "HAS_W": "constexpr", "BLOCK": "constexpr"},
                    {"HAS_W": 1, "BLOCK": 128}),
    "_row_dots": ("moe_permute", {"P": "*bf16", "idx": "*i64", "G": "*bf16", "DW": "*fp32", "D": "i32", "K": "i32",
                                  "sp": "i32", "sg": "i32", "BLOCK": "constexpr"}, {"BLOCK": 128}),
}

#: (backend, arch, warp size)
TARGETS = (("cuda", 90, 32), ("hip", "gfx942", 64))


def compile_all(num_warps: int = 8) -> dict[str, str]:
    """``{"cuda/_rms_fwd": "ok" | "FAILED: ..."}`` for every kernel and target."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results: dict[str, str] = {}
    for backend, arch, warp in TARGETS:
        target = GPUTarget(backend, arch, warp)
        for name, (module, signature, consts) in KERNELS.items():
            fn: Any = getattr(importlib.import_module(f"crosstrain.backends.triton.{module}"), name)
            key = f"{backend}/{name}"
            try:
                constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
                kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=target,
                                        options={"num_warps": num_warps})
                binary = "cubin" if backend == "cuda" else "hsaco"
                results[key] = "ok" if kernel.asm.get(binary) else f"FAILED: no {binary} produced"
            except Exception as exc:  # report every kernel, not just the first failure
                results[key] = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return results


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        print("aot_check: unset TRITON_INTERPRET (the interpreter replaces the compiler)")
        return 2
    results = compile_all()
    for key, status in results.items():
        print(f"{key:<24} {status}")
    failed = [k for k, s in results.items() if s != "ok"]
    print(f"{len(results) - len(failed)}/{len(results)} kernels compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
