"""Peak memory of LoRA DPO vs full-parameter DPO with a frozen reference copy (crosstrain's ``dpo`` recipe).

Each configuration trains ``--steps`` DPO steps in a fresh subprocess (same preset, batch and data; AdamW). The
child first runs one step on the tiny preset (so every module the Trainer imports lazily is loaded), trims the
heap and resets its peak-RSS mark (``/proc/self/clear_refs``); its figure is ``VmHWM - VmRSS at the reset``:
the model(s), gradients, optimizer state, activations and data, without the torch runtime. Both use
``parallel.activation_checkpoint = full`` by default (LoRA is usually paired with gradient checkpointing): at
this model size one step's activations otherwise outweigh the weights and optimizer state LoRA saves. The runs
alternate ABBA (``--rounds``) and the medians are compared. Last line JSON: ``lora_memory_ratio`` (LoRA peak /
full-parameter peak) and both peaks in MiB.

    python benchmarks/lora_memory.py [--preset small] [--batch-size 4] [--steps 3] [--rounds 2] [--rank 8]
                                   [--activation-checkpoint full|none]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _timing import alternate


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def child(args: argparse.Namespace) -> None:
    import torch

    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    torch.set_num_threads(1)
    common = ["backend=cpu", "train.recipe=dpo", f"train.batch_size={args.batch_size}", f"train.seq_len={args.seq_len}",
              "eval.every=0", "checkpoint.every=0", "checkpoint.final=false", "logging.progress=none",
              "logging.tensorboard=false", f"parallel.activation_checkpoint={args.activation_checkpoint}"]
    if args.child == "lora":
        common.append(f"lora.rank={args.rank}")
    # A 1-step run of the same recipe on the tiny preset first, so the modules the Trainer imports lazily
    # (checkpointing, dynamo ...) are in the baseline, then freed memory goes back to the OS before the reset.
    for overrides, measured in ((["model.preset=tiny", "train.steps=1"], False),
                                ([f"model.preset={args.preset}", f"train.steps={args.steps}"], True)):
        config = load_config(None, common + overrides)
        if measured:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as fh:  # peak RSS from here on
                fh.write("5")
            base = _status("VmRSS")
        with tempfile.TemporaryDirectory() as d:
            Trainer(config, run_dir=d).fit()
    print(json.dumps({"peak_bytes": _status("VmHWM") - base}))


def measure(args: argparse.Namespace, which: str) -> int:
    cmd = [sys.executable, __file__, "--child", which, "--preset", args.preset, "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--rank", str(args.rank),
           "--activation-checkpoint", args.activation_checkpoint]
    # A fixed glibc mmap threshold: tensors of 64 KiB and more are mapped and unmapped, so RSS falls when they are
    # freed (the default dynamic threshold moves freed activations into the heap, which keeps them resident).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1]
    return int(json.loads(out)["peak_bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch-size", type=int, default=4, help="preference pairs per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA pairs of runs")
    parser.add_argument("--rank", type=int, default=8, help="lora.rank")
    parser.add_argument("--activation-checkpoint", default="full",
                        help="parallel.activation_checkpoint of both runs (none: activations dominate at this size)")
    parser.add_argument("--child", choices=("full", "lora"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    peaks = alternate(["full", "lora"], args.rounds, lambda which, _: measure(args, which))
    full, lora = statistics.median(peaks["full"]), statistics.median(peaks["lora"])
    mib = 2**20
    print(f"peak memory above the torch runtime: full-parameter DPO + frozen reference {full / mib:.1f} MiB, "
          f"LoRA rank {args.rank} DPO {lora / mib:.1f} MiB ({args.preset}, {args.batch_size} pairs x {args.seq_len}, "
          f"activation_checkpoint={args.activation_checkpoint})")
    print(json.dumps({"lora_memory_ratio": lora / full, "full_peak_mib": full / mib, "lora_peak_mib": lora / mib,
                      "preset": args.preset, "batch_size": args.batch_size, "seq_len": args.seq_len,
                      "lora_rank": args.rank, "activation_checkpoint": args.activation_checkpoint, "steps": args.steps,
                      "rounds": args.rounds}))


if __name__ == "__main__":
    main()
