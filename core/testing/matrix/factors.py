"""The matrix's factors, what each value sets, and a cell's config overrides and 1-process reference."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

#: every factor and its values, in table order; a cell takes one value of each.
FACTORS: dict[str, tuple[str, ...]] = {
    "recipe": ("lm", "sft", "rm", "dpo", "grpo", "ppo"),
    "layout": ("1", "dp_replicate=2", "dp_shard=2", "tp=2", "pp=2", "ep=2", "dp_shard=2,tp=2"),
    "optim": ("auto", "torch"),
    "kernels": ("auto", "reference"),
    "packing": ("concat", "documents"),
    "moe": ("off", "on", "pooled"),
    "lora": ("off", "on"),
    "precision": ("fp32", "bf16"),
    "grad_accum": ("1", "2"),
    "quant": ("off", "int8"),
}

#: the run-time factors (no rule refuses any of their values here) are covered pairwise even by ``--full``; the
#: others, whose combinations the rules refuse, are crossed exhaustively there (see docs/parallelism.md).
RUNTIME_FACTORS = ("optim", "kernels", "precision", "grad_accum")

#: layout -> (world size, data-parallel degree, parallel.* overrides)
LAYOUTS: dict[str, tuple[int, int, tuple[str, ...]]] = {
    "1": (1, 1, ()),
    "dp_replicate=2": (2, 2, ("parallel.dp_replicate=2", "parallel.dp_shard=1")),
    "dp_shard=2": (2, 2, ("parallel.dp_shard=2",)),
    "tp=2": (2, 1, ("parallel.tp=2", "parallel.dp_shard=1")),
    "pp=2": (2, 1, ("parallel.pp=2", "parallel.dp_shard=1")),
    "ep=2": (2, 2, ("parallel.dp_shard=2", "parallel.ep=2")),
    "dp_shard=2,tp=2": (4, 2, ("parallel.dp_shard=2", "parallel.tp=2")),
}

#: recipes that sample (their reference, :meth:`Cell.reference`)
SAMPLING_RECIPES = ("grpo", "ppo")

#: the cheap run every cell starts from: 2 layers of width 32 (pp=2 gets a layer each, tp=2 a head each), batch
#: 8 x 32 tokens (divisible by dp 2 x accumulation 2), 8 steps, nothing written but what the loop must write.
BASE = (
    "model.n_layers=2", "model.dim=32", "model.n_heads=2", "train.batch_size=8", "train.seq_len=32",
    "train.steps=8", "schedule.warmup_steps=2", "eval.every=0", "checkpoint.final=false",
    "logging.progress=none", "logging.tensorboard=false", "observability.per_rank=false", "parallel.compile=false",
    "backend=cpu", "rlhf.max_length=32", "rlhf.max_prompt_length=24", "rl.num_generations=2",
    "rl.max_new_tokens=8", "rl.stop=",
)

#: what "on" sets for MoE ("pooled": with transformers' balance loss, an imported checkpoint's) and LoRA, and
#: "int8" for quantisation-aware training (the compress plugin)
MOE_ON = ("moe.experts=4",)
MOE_POOLED = (*MOE_ON, "moe.aux_loss=pooled")
LORA_ON = ("lora.rank=4",)
QAT_INT8 = ("quant.qat=int8",)

#: the logged metrics compared with the 1-process reference at every step and their largest relative difference:
#: fp32 differs only in reduction order (the gradient norm, a sum over every parameter, a little more); bf16 rounds
#: activations to 8 mantissa bits (2^-8 = 3.9e-3 per op). GRPO's loss is 0 by construction on the first pass over
#: a rollout; its gradient norm is not.
TOLERANCE = {"fp32": {"loss": 1e-5, "grad_norm": 1e-4}, "bf16": {"loss": 2e-2, "grad_norm": 1e-1}}

#: quant=int8 (quantisation-aware training): fake quantisation is discontinuous, so once a layout's reduction order
#: (1e-7) has moved a weight or activation across a rounding boundary, that value moves by a whole int8 grid step.
#: The first step (the same weights: the scales reduced over the layout) is held to the precision's tolerance; from
#: the first update on the runs part by such flips (measured on the pairwise cells: loss up to 3.2e-3, grad norm up
#: to 2.5e-1 and, through grpo's sampling, more), so later steps compare the loss only, to this tolerance.
QAT_LOSS = 1e-2


@dataclass(frozen=True)
class Cell:
    """One combination of factor values (strings, as in :data:`FACTORS`)."""

    recipe: str
    layout: str
    optim: str
    kernels: str
    packing: str
    moe: str
    lora: str
    precision: str
    grad_accum: str
    quant: str = "off"

    @classmethod
    def from_row(cls, row: tuple[str, ...]) -> Cell:
        return cls(*row)

    def row(self) -> tuple[str, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def world(self) -> int:
        return LAYOUTS[self.layout][0]

    @property
    def dp(self) -> int:
        return LAYOUTS[self.layout][1]

    def overrides(self, backend: str = "cpu") -> list[str]:
        """The ``--set`` items of this cell (``BASE`` first) on ``backend``."""
        base = [item if item != "backend=cpu" else f"backend={backend}" for item in BASE]
        out = [*base, f"train.recipe={self.recipe}", *LAYOUTS[self.layout][2], f"optim.impl={self.optim}",
               f"kernels.mode={self.kernels}", f"data.packing={self.packing}", f"precision.dtype={self.precision}",
               f"train.grad_accum={self.grad_accum}"]
        moe = {"on": MOE_ON, "pooled": MOE_POOLED}.get(self.moe, ())
        return [*out, *moe, *(LORA_ON if self.lora == "on" else ()),
                *(QAT_INT8 if self.quant == "int8" else ())]

    def reference(self) -> Cell:
        """The same config on one process. Micro-batch ``i`` of all dp ranks together is micro-batch ``i`` of one
        process (core/data/sampler.py), and grpo/ppo sample each prompt from its own noise
        (plugins/rlhf/rl/rollout.py), so even terms over a whole micro-batch (MoE's global balance loss) agree.
        Without MoE, grpo/ppo's reference runs ``grad_accum x dp`` micro-batches, each one rank's micro-batch: in
        bf16 a differently composed batch rounds differently, and after a few steps that flips a sampled token."""
        sampling = self.recipe in SAMPLING_RECIPES and self.moe == "off"
        return replace(self, layout="1", grad_accum=str(int(self.grad_accum) * (self.dp if sampling else 1)))

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


assert tuple(f.name for f in fields(Cell)) == tuple(FACTORS), "Cell's fields are the factors, in order"
