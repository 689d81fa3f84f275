"""Quantization-aware training vs post-training quantization, side by side in one run (issue 30).

Two runs on the embedded corpus with equal total steps, data and seed: ``fp32`` (``quant.qat = "none"``, N steps)
and ``qat``: the same run resumed from its checkpoint at step N - K and **fine-tuned with fake quantisation**
(``quant.qat = "int8-act-int4-weight"``) for the last K steps (torchao's recipe: QAT as a fine-tune of a trained
model), so the step count, data order and LR schedule are the fp32 run's. The schedule decays to zero
(``schedule.min_lr_ratio = 0``), so both runs end on settled weights: at the default floor (10% of the peak) the
QAT weights still hop across int4 rounding steps at the last step, and the recovery moved with the seed and the ISA
(0.47-0.72, docs/compress.md). ``--quick``: 900 steps, the last 300 with QAT, on a GPT of ``dim=64``, 4 layers and
int4 groups of 64 (one scale per output channel of the 64-wide layers), where int4 PTQ loses about 2% of the loss
and int8 PTQ next to nothing. On the whole held-out split (``crosstrain eval``'s evaluation with
``eval.max_batches = 0``; ``--eval-batches N`` takes the first N):

- ``loss_fp32``: the fp32 run in floating point;
- ``loss_ptq``: the same fp32 weights, fake-quantised with the scheme (post-training quantization: the eval is
  built under the QAT config, so the transform quantises the loaded weights);
- ``loss_qat``: the QAT run, fake-quantised as it trained;
- ``loss_ptq_int8``: the fp32 weights under ``int8`` (int8 weights per channel): the scheme where PTQ alone is
  enough, next to the int4 one where it is not.

``recovery = (loss_ptq - loss_qat) / (loss_ptq - loss_fp32)``: the share of the loss PTQ loses that QAT wins
back: torchao's figure of merit ("recover 77% of quantized perplexity degradation on Llama-3.2-3B with QAT", its
README), here on the loss (log perplexity). Then the QAT run exported with ``--quantize`` (integer ONNX, int4
blocks) and the fp32 run exported plainly:
``size_ratio`` = quantised .onnx bytes / fp32 .onnx bytes (both without the exporter's per-node debug records, which
the quantised export strips), and the onnxruntime parity of the quantised model against the fake-quantised one.

Hosts: the script trains eagerly with the reference kernels and torch's optimizer (crosstrain's native CPU kernels
pick their ISA at run time; ``parallel.compile = "auto"`` would choose by a per-user record and run inductor's code
generated for the host) on one thread and states the host (CPU model, flags, the ISA ATen dispatches to, any pins)
in the JSON. ``--isa avx2`` takes an AVX2 host's code paths on any newer one: it pins, before torch loads, MKL to
its AVX2 branch with conditional numerical reproducibility (``MKL_CBWR=AVX2,STRICT``), torch's own kernels
(``ATEN_CPU_CAPABILITY=avx2``) and oneDNN's (``ONEDNN_MAX_CPU_ISA=AVX2``).

    python benchmarks/qat.py --quick               # this host's ISA; last line: JSON
    python benchmarks/qat.py --quick --isa avx2    # as an AVX2 host
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

#: ``--isa avx2``: the code paths of an AVX2 host (read when torch loads: set before any import of it)
AVX2_PINS = {"MKL_CBWR": "AVX2,STRICT", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

SCHEME = "int8-act-int4-weight"


def _config(args: argparse.Namespace, qat: str, *extra: str):  # type: ignore[no-untyped-def]
    from crosstrain.config import load_config

    return load_config(None, [*extra,
        "backend=cpu", "kernels.mode=reference", "optim.impl=torch", "parallel.compile=false", "model.preset=tiny",
        f"model.dim={args.dim}", f"model.n_layers={args.layers}",
        f"train.steps={args.steps}", f"train.batch_size={args.batch_size}", f"train.seq_len={args.seq_len}",
        f"model.ffn_dim={args.ffn_dim}", "eval.every=0", "checkpoint.final=true", "checkpoint.keep_last=10",
        "logging.progress=none", "logging.tensorboard=false", "schedule.warmup_steps=10", f"train.seed={args.seed}",
        f"quant.qat={qat}", f"quant.group_size={args.group_size}", f"optim.lr={args.lr}",
        f"optim.weight_decay={args.weight_decay}", f"schedule.min_lr_ratio={args.min_lr_ratio}",
        f"eval.max_batches={args.eval_batches}"])


def _train(args: argparse.Namespace, qat: str, run_dir: Path, *extra: str) -> Path:
    from crosstrain.engine import Trainer

    Trainer(_config(args, qat, *extra), run_dir=str(run_dir)).fit()
    return run_dir / "checkpoints" / f"step_{args.steps}"


def _eval(args: argparse.Namespace, qat: str, step_dir: Path) -> float:
    from crosstrain.engine.evaluate_checkpoint import evaluate_checkpoint

    return float(evaluate_checkpoint(_config(args, qat), step_dir)["loss"])


def _host() -> dict[str, object]:
    """The CPU the figures come from: model name and its vector-ISA flags (Linux' /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    isa = sorted(f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"))
    import torch

    pins = {k: os.environ[k] for k in AVX2_PINS if k in os.environ}
    return {"cpu": model, "isa_flags": isa, "pins": pins,
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _stripped_size(path: Path) -> int:
    """Bytes of ``path`` without the exporter's per-node debug records (as the quantised export writes it)."""
    import onnx

    model = onnx.load(str(path))
    for node in model.graph.node:
        del node.metadata_props[:]
    return len(model.SerializeToString())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small and fast (the acceptance run)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--qat-steps", type=int, default=0,
                   help="K: fine-tune steps with fake quantisation (0: N / 3)")
    p.add_argument("--ffn-dim", type=int, default=192, help="a multiple of --group-size")
    p.add_argument("--group-size", type=int, default=64, help="int4 weights per scale (--dim: one per channel)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (optim.lr)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay")
    p.add_argument("--min-lr-ratio", type=float, default=0.0,
                   help="final LR as a share of --lr (schedule.min_lr_ratio; 0: the weights settle)")
    p.add_argument("--eval-batches", type=int, default=0, help="held-out batches evaluated (0: the whole split)")
    p.add_argument("--isa", choices=("host", "avx2"), default="host",
                   help="avx2: an AVX2 host's code paths (MKL, oneDNN and ATen pinned to their AVX2 paths)")
    args = p.parse_args()
    if args.isa == "avx2":
        os.environ.update(AVX2_PINS)
    if args.quick:
        args.steps, args.batch_size, args.seq_len = 900, 8, 64
    k = args.qat_steps or args.steps // 3

    import torch

    torch.set_num_threads(1)
    from crosstrain.plugins.compress.qat.export import export_quantized_onnx
    from crosstrain.plugins.compress.qat.schemes import scheme
    from crosstrain.plugins.export.loading import load_model
    from crosstrain.plugins.export.onnx_export import export_onnx

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="crosstrain-qat-bench-") as tmp:
        root = Path(tmp)
        fp_ckpt = _train(args, "none", root / "fp32", f"checkpoint.every={args.steps - k}")
        qat_ckpt = _train(args, SCHEME, root / "qat", "checkpoint.every=0",
                          f"checkpoint.resume={root / 'fp32' / 'checkpoints' / f'step_{args.steps - k}'}")
        train_s = time.perf_counter() - t0
        loss_fp32 = _eval(args, "none", fp_ckpt)
        loss_ptq = _eval(args, SCHEME, fp_ckpt)
        loss_ptq_int8 = _eval(args, "int8", fp_ckpt)  # int8 weights: PTQ alone loses next to nothing
        loss_qat = _eval(args, SCHEME, qat_ckpt)
        with_fp = _eval(args, "none", qat_ckpt)  # the QAT weights run in floating point
        fp_report = export_onnx(load_model(root / "fp32"), root / "fp32.onnx")
        q_report = export_quantized_onnx(load_model(root / "qat"), root / "qat.onnx",
                                         scheme(SCHEME, args.group_size))
        fp_bytes, fp_bytes_raw = _stripped_size(root / "fp32.onnx"), (root / "fp32.onnx").stat().st_size
        q_bytes = (root / "qat.onnx").stat().st_size
    gap = loss_ptq - loss_fp32
    result = {
        "scheme": SCHEME, "group_size": args.group_size, "lr": args.lr, "weight_decay": args.weight_decay,
        "min_lr_ratio": args.min_lr_ratio, "eval_batches": args.eval_batches,
        "steps": args.steps, "qat_from_step": args.steps - k,
        "model": {"preset": "tiny", "dim": args.dim, "n_layers": args.layers, "ffn_dim": args.ffn_dim},
        "loss_fp32": loss_fp32, "loss_ptq": loss_ptq, "loss_qat": loss_qat, "loss_qat_weights_fp": with_fp,
        "loss_ptq_int8": loss_ptq_int8,
        "recovery": (loss_ptq - loss_qat) / gap if gap > 0 else None,
        "size_ratio": q_bytes / fp_bytes, "size_ratio_vs_raw_fp32_export": q_bytes / fp_bytes_raw,
        "onnx_bytes_quantized": q_bytes, "onnx_bytes_fp32": fp_bytes,
        "parity_quantized_max_abs_logit_err": q_report.parity.max_abs_err,
        "parity_quantized_prefill": q_report.parity.max_abs_err_prefill,
        "parity_quantized_decode": q_report.parity.max_abs_err_decode,
        "parity_fp32_max_abs_logit_err": fp_report.parity.max_abs_err,
        "host": _host(), "threads": torch.get_num_threads(), "torch": torch.__version__, "train_s": train_s,
        "total_s": time.perf_counter() - t0,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
