"""The configuration schema: one pydantic model per TOML section, unknown keys rejected.

Key names listed in the README (``train.steps``, ``optim.lr``, ``parallel.dp_shard``, ``checkpoint.every``, ...)
are a stable interface. Defaults describe ``crosstrain train`` with no arguments: the ``tiny`` GPT on the
embedded corpus, tuned to reach well under 60% of the initial loss in about a minute on two CPU cores.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class TrainConfig(Section):
    steps: int = Field(default=400, ge=1, description="optimizer steps")
    recipe: str = Field(default="lm", description='what is trained and how: "lm" (pretraining) or a plugin\'s recipe')
    seed: int = Field(default=0, ge=0, description="seeds the weights' init, the data order and dropout")
    batch_size: int = Field(default=16, ge=1, description="global sequences per optimizer step")
    seq_len: int = Field(default=128, ge=2, description="tokens per training sequence")
    grad_accum: int = Field(default=1, ge=1, description="micro-batches per optimizer step on each rank")
    output_dir: str = Field(default="runs", description="run dirs are created as <output_dir>/<timestamp>/")
    threads: int = Field(default=0, ge=0, description="host intra-op threads; 0 = auto (1 for models under 20M params "
                         "unless OMP_NUM_THREADS is set, where extra threads only spin; else torch's default)")


class ModelConfig(Section):
    preset: str = Field(default="tiny", description="the model shape by name (`crosstrain models` lists each "
                                                    "family's presets); model.* keys override its fields")
    source: Literal["auto", "native", "transformers"] = Field(
        default="auto", description='"auto": a native family when model.init_from\'s model_type has one, else the '
        'generic transformers path; "native": always crosstrain\'s own model; "transformers": any '
        "AutoModelForCausalLM (docs/models.md)")
    import_path: str = Field(default="", description='user model "pkg.module:build"; build(model_section) -> nn.Module')
    vocab_size: int | None = Field(default=None, ge=2, description="vocabulary size (unset: the preset's, or "
                                                                   "data.tokenizer's)")
    dim: int | None = Field(default=None, ge=1, description="hidden size (unset: the preset's)")
    n_layers: int | None = Field(default=None, ge=1, description="transformer blocks (unset: the preset's)")
    n_heads: int | None = Field(default=None, ge=1, description="attention heads (unset: the preset's)")
    n_kv_heads: int | None = Field(default=None, ge=0, description="key/value heads, fewer than n_heads for "
                                                                   "grouped-query attention (unset: the preset's)")
    ffn_dim: int | None = Field(default=None, ge=0, description="hidden size of the MLP (unset: the preset's)")
    max_seq_len: int | None = Field(default=None, ge=1, description="longest sequence the positions cover (unset: "
                                                                    "the preset's)")
    tie_embeddings: bool | None = Field(default=None, description="share the input embedding and output projection "
                                                                  "weights (unset: the preset's)")
    qkv_bias: bool | None = Field(default=None, description="biases on the q/k/v projections (as in Qwen2)")
    sliding_window: int | None = Field(default=None, ge=0, description="each token attends to at most this many "
                                       "tokens, itself included (Mistral-style); 0 = full causal attention")
    init_from: str = Field(default="", description="a Hugging Face model folder (any causal LM, see model.source): "
                           "its config.json gives the shape and its safetensors the initial weights; or a "
                           "crosstrain RUN_DIR, CHECKPOINT_DIR or FILE.safetensors (shape from model.*)")
    options: dict[str, Any] = Field(default_factory=dict, description="free-form arguments for a user model")


class DataConfig(Section):
    path: str = Field(default="", description='token file from "crosstrain data prepare" ("" = the embedded corpus)')
    shuffle: bool = Field(default=True, description="shuffle the training sequences (seeded by train.seed)")
    val_fraction: float = Field(default=0.05, ge=0, lt=1, description="share of the tokens held out for evaluation "
                                "(from the end of the data; cut inside a document only where no boundary is near)")
    val_path: str = Field(default="", description="a separate validation token file (replaces the held-out split)")
    tokenizer: str = Field(default="", description='"" (bytes) or a folder with a tokenizer.json; data.path must '
                           "have been prepared with it, and export and generation use it")
    packing: Literal["concat", "documents"] = Field(default="concat", description='"documents": attention stays '
                                                    "inside each document and positions restart at its start")
    skip_bad_rows: bool = Field(default=False, description="JSONL recipes (sft/rm/dpo): skip malformed rows, counted, "
                                "instead of stopping at the first one")
    chat_template: str = Field(default="auto", min_length=1, description='JSONL recipes: how "messages" rows become '
                               'text; "auto" = the data.tokenizer folder\'s chat template (transformers\' '
                               "apply_chat_template) when it has one, else crosstrain's <|role|> format; \"none\" = "
                               "crosstrain's format; or the path of a Jinja chat template (docs/rlhf.md)")


class OptimConfig(Section):
    name: Literal["adamw", "sgd"] = Field(default="adamw", description="the optimizer")
    lr: float = Field(default=3e-3, gt=0, description="peak learning rate (after warmup, see [schedule])")
    weight_decay: float = Field(default=0.1, ge=0, description="decoupled weight decay (AdamW) or L2 penalty (SGD)")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        default=(0.9, 0.95), description="AdamW's decay rates of the first and second moment estimates")
    eps: float = Field(default=1e-8, gt=0, description="AdamW's term added to the denominator")
    momentum: float = Field(default=0.9, ge=0, description="SGD only")
    grad_clip: float = Field(default=1.0, ge=0, description="max global grad norm (0 = no clipping)")
    offload: bool = Field(default=False, description="keep fp32 master weights and optimizer state in host memory "
                                                     "and step there (docs/native_kernels.md)")
    impl: Literal["auto", "torch", "native"] = Field(default="auto", description='"auto": the backend\'s fastest '
                                                     'step matching torch.optim (native fused on the CPU, torch '
                                                     'fused=True on accelerators); "torch": torch.optim; "native": '
                                                     "the backend's, or an error")


class ScheduleConfig(Section):
    name: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="learning-rate decay after warmup, down to min_lr_ratio x optim.lr")
    warmup_steps: int = Field(default=20, ge=0, description="steps of linear warmup from 0 to optim.lr")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="final learning rate as a share of optim.lr")
    total_steps: int = Field(default=0, ge=0, description="steps the schedule spans; 0 = train.steps. Set the "
                             "final length when a run trains in parts (resumed to a larger train.steps, PBT rounds) so "
                             "the decay does not restart")


class ParallelConfig(Section):
    dp_replicate: int = Field(default=1, ge=1, description="data-parallel replicas (each holds the whole model; DDP, "
                                                           "or HSDP with dp_shard > 1)")
    dp_shard: int = Field(default=-1, ge=-1, description="-1 = whatever the other dims leave of the world size")
    tp: int = Field(default=1, ge=1, description="tensor-parallel degree")
    pp: int = Field(default=1, ge=1, description="pipeline-parallel stages")
    ep: int = Field(default=1, ge=1, description="expert parallel; carved from dp_shard, so it must divide it")
    pp_schedule: Literal["gpipe", "1f1b"] = Field(default="1f1b", description="pipeline schedule (with pp > 1)")
    pp_microbatches: int = Field(default=0, ge=0, description="0 = one per pipeline stage")
    activation_checkpoint: str = Field(default="none", pattern=r"^(none|full|every:[1-9][0-9]*)$",
                                       description='recompute activations in the backward pass: "none", "full" '
                                       '(every block) or "every:N" (every Nth block)')
    compile: Literal["auto"] | bool = Field(default="auto", description='"auto": compile when the saving over '
                                            "the steps left (train.steps minus a resumed checkpoint's step; "
                                            "recorded per model shape + layout, else estimated) exceeds the "
                                            "compile time (recorded, else a cold ~40 s), never on a layout "
                                            "that does not compile (tp > 1), not by itself with pp/ep > 1; "
                                            "true / false force it")
    layout: Literal["auto", "ddp", "fsdp"] = Field(default="auto", description="with parallel.dp_shard=-1: "
                                                   '"auto" = DDP when model, gradients and optimizer state fit '
                                                   'comfortably on each rank, else FSDP2; "ddp" / "fsdp" force it')


class PrecisionConfig(Section):
    dtype: Literal["fp32", "bf16", "fp16"] = Field(default="fp32", description="compute dtype (bf16/fp16: autocast; "
                                                                               "fp16 with a dynamic loss scale)")
    init_loss_scale: float = Field(default=2.0**16, gt=0, description="fp16 only")
    loss_scale_growth_interval: int = Field(default=2000, ge=1, description="fp16 only")


class CheckpointConfig(Section):
    # on with eval.every's 100, so checkpoint.keep_best adds no evaluations; the clock covers runs of slow steps
    every: int = Field(default=100, ge=0, description="save every N steps (0 = off)")
    every_minutes: float = Field(default=10.0, ge=0, description="also save when this many minutes passed since "
                                 "the last save, by rank 0's clock (0 = off), so a crash loses at most that")
    keep_last: int = Field(default=3, ge=1, description="checkpoints kept, newest first (older ones are deleted)")
    keep_every: int = Field(default=0, ge=0, description="also keep every checkpoint whose step is a multiple of N "
                                                         "(0 = off)")
    keep_best: bool = Field(default=False, description="retention never deletes the checkpoint with the best eval "
                            "loss (evaluated at every save)")
    async_save: bool = Field(default=False, alias="async", description="write checkpoints in the background while "
                                                                       "training goes on")
    final: bool = Field(default=True, description="save a checkpoint when the run ends (a preempted run always saves)")
    resume: str = Field(default="auto", description='"auto" (latest in the run dir), "never", or a checkpoint path')


class EvalConfig(Section):
    every: int = Field(default=100, ge=0, description="evaluate every N steps and after the last (0 = off)")
    max_batches: int = Field(default=20, ge=0, description='batches per evaluation, taken in order from the start '
                             'of the validation split (0 or "all" = the whole split; "eval.steps" is its old name)')
    batch_size: int = Field(default=0, ge=0, description="sequences per eval batch (0 = train.batch_size)")
    tasks: list[str] = Field(default_factory=list, description="lm-evaluation-harness tasks scored at each "
                             "evaluation (registered names or local task YAML paths; needs crosstrain[eval]), "
                             "reported as eval/<task>/<metric>")
    tasks_limit: int | None = Field(default=None, ge=1, description="score only the first N items of each of "
                                    "eval.tasks (None = all)")

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and "steps" in data:  # eval.steps was this key's name; configs keep working
            if "max_batches" in data:
                raise ValueError("eval.steps is the old name of eval.max_batches; set only eval.max_batches")
            data = {**data, "max_batches": data["steps"]}
            del data["steps"]
        return data

    @field_validator("max_batches", mode="before")
    @classmethod
    def _all_batches(cls, value: Any) -> Any:
        return 0 if value == "all" else value

    @field_validator("tasks")
    @classmethod
    def _tasks_runnable(cls, tasks: list[str]) -> list[str]:
        import importlib.util
        from pathlib import Path

        if tasks and importlib.util.find_spec("lm_eval") is None:
            raise ValueError("eval.tasks needs lm-evaluation-harness; pip install 'crosstrain[eval]'")
        for task in tasks:
            if task.endswith((".yaml", ".yml")) and not Path(task).is_file():
                raise ValueError(f"task file {task!r} does not exist; give an lm-eval task YAML path or a name")
        return tasks


class FaultConfig(Section):
    max_consecutive_nonfinite: int = Field(default=3, ge=1, description="roll back after N skipped steps in a row")
    max_rollbacks: int = Field(default=3, ge=0, description="stop with an error when training diverges again after "
                               "N rollbacks in one run")
    collective_timeout_s: float = Field(default=600.0, gt=0, description="seconds a collective waits for the other "
                                                                         "ranks before the process group times out")


class LoggingConfig(Section):
    every: int = Field(default=10, ge=1, description="print a line every N steps (no TTY)")
    progress: Literal["auto", "rich", "plain", "none"] = Field(
        default="auto", description='progress display: "auto" = rich on a TTY, else plain lines')
    tensorboard: bool = Field(default=True, description="write TensorBoard event files into the run dir's "
                              'tensorboard/ where TensorBoard is installed (pip install "crosstrain[tensorboard]"); '
                              "without it, nothing and no warning")


class KernelsConfig(Section):
    mode: Literal["auto", "reference"] = Field(default="auto", description='"auto": the backend\'s fast '
                                               'kernels where registered; "reference": plain torch everywhere '
                                               "(as CROSSTRAIN_KERNELS=reference)")


#: core sections, in the order they are written to config.toml.
CORE_SECTIONS: dict[str, type[Section]] = {
    "train": TrainConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "parallel": ParallelConfig,
    "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "fault": FaultConfig,
    "logging": LoggingConfig,
    "kernels": KernelsConfig,
}


class Config(BaseModel):
    """The whole configuration. ``config.section(name)`` reaches core and plugin sections alike."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    backend: str = Field(default="auto", description='"auto" (the available backend with the highest '
                         "priority, `crosstrain backends`) or a backend by name")
    train: TrainConfig = Field(default_factory=TrainConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    plugins: dict[str, BaseModel] = Field(default_factory=dict)

    def section(self, name: str) -> BaseModel:
        """A core or plugin section by name; unknown names raise KeyError listing the known ones."""
        if name in CORE_SECTIONS:
            return getattr(self, name)
        if name in self.plugins:
            return self.plugins[name]
        known = ", ".join([*CORE_SECTIONS, *self.plugins])
        raise KeyError(f"no config section {name!r}; known sections: {known}")

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (TOML key names, e.g. ``checkpoint.async``), plugin sections at top level."""
        out: dict[str, Any] = {"backend": self.backend}
        for name in CORE_SECTIONS:
            out[name] = getattr(self, name).model_dump(mode="json", by_alias=True)
        for name, section in self.plugins.items():
            out[name] = section.model_dump(mode="json", by_alias=True)
        return out
