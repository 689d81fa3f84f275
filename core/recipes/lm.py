"""``lm``: next-token language-model pretraining, crosstrain's default recipe.

One trainable model (the built-in GPT from ``model.preset``, or ``model.import_path``'s callable),
:class:`~crosstrain.data.TokenBatch` batches cut from the token dataset, and the mean token cross-entropy
through the kernel registry (``crosstrain.kernels.cross_entropy``). Runs under every layout, pipeline
parallelism included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from crosstrain import kernels
from crosstrain.config import Config, gpt_config, resolve_import_path
from crosstrain.data import TokenBatch, TokenDataset
from crosstrain.data.dataset import build_datasets
from crosstrain.engine.recipe import MicroBatchLoss, ModelSpec, Recipe
from crosstrain.errors import ConfigError

if TYPE_CHECKING:
    from crosstrain.engine.context import RunContext


def build_model(config: Config) -> nn.Module:
    """The built-in GPT from ``model.preset`` (+ overrides) or with ``model.init_from``'s Hugging Face weights, or
    ``model.import_path``'s callable."""
    if config.model.import_path:
        builder = resolve_import_path(config.model.import_path)
        model = builder(config.model)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.import_path {config.model.import_path!r} returned "
                              f"{type(model).__name__}, not a torch.nn.Module")
        return model
    from crosstrain.models.family import family_for_run

    family = family_for_run(config)
    model = family.build(gpt_config(config))
    if config.model.init_from and family.path == "native":  # the generic path's build loads its own weights
        from crosstrain.checkpoint.resolve import source_kind
        from crosstrain.models.hf import load_hf_weights

        if source_kind(config.model.init_from, what="model.init_from") == "hf":
            load_hf_weights(model, config.model.init_from)
            _warn_ignored_dropout(config.model.init_from)
        else:
            load_crosstrain_weights(model, config.model.init_from)
    return model


def _warn_ignored_dropout(folder: str) -> None:
    """One warning (rank 0) when the imported config.json asks for dropout the native model does not apply."""
    import os
    import warnings

    from crosstrain.errors import CrosstrainWarning
    from crosstrain.models.hf import read_hf_config
    from crosstrain.models.hf.config import ignored_dropout

    dropped = ignored_dropout(read_hf_config(folder))
    if dropped and os.environ.get("RANK", "0") == "0":
        fields = ", ".join(f"{k}={v:g}" for k, v in sorted(dropped.items()))
        warnings.warn(f"model.init_from {folder}: {fields} not applied (crosstrain's native models train without "
                      "dropout); set model.source=transformers to train with it", CrosstrainWarning, stacklevel=2)


def crosstrain_weights(path: str, *, what: str = "model.init_from") -> tuple[dict[str, torch.Tensor], str]:
    """The full model tensors of ``FILE.safetensors`` or of a checkpoint saved under any layout (a ``step_N``
    folder, a checkpoints folder or a run dir: the newest valid checkpoint), and the path actually read.
    ``what`` names ``path`` in errors."""
    from crosstrain.checkpoint.consolidate import load_consolidated
    from crosstrain.checkpoint.resolve import resolve_path
    from crosstrain.models.hf.weights import load_safetensors

    source = resolve_path(path, what=what, accept=("checkpoint", "safetensors"))
    tensors = load_safetensors(source.path) if source.kind == "safetensors" else load_consolidated(source)
    return tensors, str(source.path.resolve())


@torch.no_grad()
def load_crosstrain_weights(model: nn.Module, path: str, *, what: str = "model.init_from") -> None:
    """Copy crosstrain weights (:func:`crosstrain_weights`) into ``model``, every name and shape checked."""
    tensors, source = crosstrain_weights(path, what=what)
    own = model.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    wrong = [k for k in own if k in tensors and tuple(tensors[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or wrong:
        problem = (f"the source's {wrong[0]} is {tuple(tensors[wrong[0]].shape)}, this model's "
                   f"{tuple(own[wrong[0]].shape)}" if wrong
                   else f"the source lacks {missing[0]}" if missing else f"the source has {unexpected[0]} too")
        raise ConfigError(f"{what} {source} does not fit this model ({problem}); {_source_shape(path, what)}")
    for name, value in own.items():
        value.copy_(tensors[name].to(value.dtype))


def _source_shape(path: str, what: str) -> str:
    """What to do about a mismatch: the shape the source's run states, or which keys to set without one."""
    from crosstrain.models.gpt_family import origin_config, shape_text
    from crosstrain.models.init_chain import init_origin

    origin = init_origin(path, what=what)
    if origin is None or origin.model.get("import_path"):
        return ("it has no run config.json to take the shape from, so set the model.* keys it was trained with "
                "(or put it back in its run dir)")
    return (f"its run's model has {shape_text(origin_config(origin))} (from {origin.describe()}); remove the "
            "model.* keys that differ, or a plugin section that changes the model")


def init_from_record(config: Config, model: nn.Module) -> dict[str, Any] | None:
    """What summary.json records about ``model.init_from``: the folder, its model_type and the
    ``params_sha256`` of the weights as imported (call before training changes them); None without init_from."""
    if not config.model.init_from:
        return None
    from crosstrain.checkpoint.resolve import resolve_path
    from crosstrain.engine.state import params_sha256
    from crosstrain.models.hf import read_hf_config

    sha = params_sha256({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)})
    source = resolve_path(config.model.init_from, what="model.init_from")
    if source.kind != "hf":  # crosstrain weights: the step folder or file actually read
        return {"source": str(source.path.resolve()), "format": "crosstrain", "sha256": sha}
    return {"source": str(source.path.resolve()), "model_type": read_hf_config(source.path).get("model_type"),
            "sha256": sha}


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits [..., V]`` against ``targets [...]``."""
    return kernels.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class LMRecipe(Recipe):
    """Pretraining: the model named ``model`` learns to predict each next token."""

    name = "lm"
    supports_pipeline = True
    loss_is_token_nll = True

    def __init__(self) -> None:
        self.dataset: TokenDataset | None = None
        self.eval_dataset: TokenDataset | None = None
        self.split: dict[str, Any] = {}
        self.init_record: dict[str, Any] | None = None

    def validate(self, config: Config) -> None:
        if config.model.import_path:
            resolve_import_path(config.model.import_path)
        from crosstrain.data.manifest import check_tokenizer

        for path in (config.data.path, config.data.val_path):
            if path:
                check_tokenizer(path, config.data.tokenizer)
        self.dataset, self.eval_dataset, self.split = build_datasets(config.data, config.train.seq_len)
        if config.data.packing == "documents":
            if config.model.import_path or config.parallel.pp > 1:
                raise ConfigError("data.packing='documents' needs the built-in GPT (it takes doc_ids) and "
                                  "parallel.pp=1; set data.packing='concat'")
            from crosstrain.data.packing import pack_datasets

            self.dataset, self.eval_dataset = pack_datasets(  # type: ignore[assignment]
                config.data, self.dataset, self.eval_dataset, self.split)
        if not config.model.import_path:
            vocab = gpt_config(config).vocab_size
            if self.dataset.vocab_size > vocab:
                raise ConfigError(f"the data's vocabulary ({self.dataset.vocab_size}) is larger than "
                                  f"model.vocab_size={vocab}; raise model.vocab_size")

    def build_models(self, context: RunContext) -> dict[str, ModelSpec]:
        model = build_model(context.config)
        self.init_record = init_from_record(context.config, model)
        return {"model": ModelSpec(model)}

    def summary(self) -> dict[str, Any]:
        return {"init_from": self.init_record} if self.init_record else {}

    def build_dataset(self, context: RunContext) -> TokenDataset:
        if self.dataset is None:
            self.validate(context.config)
        assert self.dataset is not None
        return self.dataset

    def build_eval_dataset(self, context: RunContext) -> TokenDataset | None:
        self.build_dataset(context)
        return self.eval_dataset

    def data_split(self) -> dict[str, Any]:
        return self.split

    def loss(self, models: Mapping[str, nn.Module], batch: TokenBatch) -> MicroBatchLoss:
        if batch.document_ids is not None:  # data.packing = "documents"
            logits = models["model"](batch.inputs, doc_ids=batch.document_ids)
        else:
            logits = models["model"](batch.inputs)
        return MicroBatchLoss(next_token_loss(logits, batch.targets))

    def pipeline_batch(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if batch.document_ids is not None:  # validate() refuses packing under pp; never drop the ids silently
            raise ConfigError("data.packing='documents' cannot run under parallel.pp > 1; set data.packing='concat'")
        return batch.inputs, batch.targets

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return next_token_loss(output, target)
