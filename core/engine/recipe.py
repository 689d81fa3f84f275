"""Recipes: what is trained and how, apart from the loop that guarantees how training runs.

The loop (:class:`crosstrain.engine.Trainer`) owns counters, gradient accumulation, clipping, mixed precision
and fp16 loss scaling, the non-finite guard and rollback, checkpoints and exact resume, preemption, metrics
and teardown. A recipe owns its named models (trainable or frozen), its dataset, the loss of one micro-batch
and any extra state to checkpoint. The loop calls the recipe; a recipe never re-implements a loop guarantee.

Recipes come from the built-in ``lm`` (next-token pretraining, the default) and from plugins'
``crosstrain_recipe(name)`` hooks; ``train.recipe`` / ``crosstrain train --recipe NAME`` picks one.
See docs/recipes.md for a complete recipe plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from crosstrain import pluginmanager
from crosstrain.errors import ConfigError, PluginError

if TYPE_CHECKING:
    from crosstrain.config import Config
    from crosstrain.engine.context import RunContext


@dataclass
class ModelSpec:
    """One model of a recipe. Trainable models get gradients, an optimizer and a checkpoint entry; frozen ones
    are parallelised for inference only and recorded in checkpoints by ``source`` and SHA-256, not re-saved."""

    module: nn.Module
    trainable: bool = True
    source: str = ""
    #: whether the plugins' ``crosstrain_transform_model`` may change the model. ``None``: trainable models
    #: yes, frozen ones no, so a model loaded frozen from ``source`` keeps those weights (its SHA-256 is the
    #: source's). A frozen copy of a trainable model (a reference policy) sets True to stay its copy.
    transform: bool | None = None
    #: learning-rate multiplier per parameter name (``module.named_parameters()``, before parallelisation); names
    #: not listed train at 1.0. Layer-wise lr decay for fine-tuning (timm's ``param_groups_layer_decay``).
    lr_scale: dict[str, float] = field(default_factory=dict)

    @property
    def transformable(self) -> bool:
        """``transform`` resolved: the plugins' model transforms run on this model."""
        return self.trainable if self.transform is None else self.transform


@dataclass
class MicroBatchLoss:
    """A recipe's result for one micro-batch: the scalar ``loss`` the loop backpropagates (auxiliary losses
    are added by the loop) and extra ``metrics`` (scalars), averaged over micro-batches and data-parallel
    ranks like the loss and reported under their own names (e.g. TRL's ``rewards/chosen``)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor | float] = field(default_factory=dict)


@runtime_checkable
class RecipeDataset(Protocol):
    """Samples addressed by index; the loop's resumable sampler picks the indices for each rank. A dataset may
    also have ``set_epoch(epoch)``: the loop calls it before each step's ``batch`` calls with the sampler's epoch
    of those indices (per-sample augmentation seeded by epoch and index resumes exactly)."""

    def __len__(self) -> int: ...

    def batch(self, indices: Any) -> Any:
        """The batch of these sample indices: a tensor, or a tuple/list/dict of tensors."""
        ...


class Recipe:
    """Base class of recipes; override :meth:`build_models`, :meth:`build_dataset` and :meth:`loss`."""

    #: the name ``train.recipe`` selects it by.
    name: ClassVar[str] = ""
    #: whether the recipe runs under ``parallel.pp > 1``: then it has exactly one model and supplies
    #: :meth:`pipeline_batch` and :meth:`pipeline_loss`, which the pipeline schedule calls.
    supports_pipeline: ClassVar[bool] = False
    #: evaluate once before the first step too (summary.json gets ``eval_before`` and ``eval_after``).
    eval_at_start: ClassVar[bool] = False
    #: the loss is a mean token negative log-likelihood (nats), so ``exp(loss)`` is a perplexity and evaluation
    #: reports ``eval/perplexity``; a subclass that changes the loss (adds a KL term, scores pairs) sets False.
    loss_is_token_nll: ClassVar[bool] = False
    #: the step metrics the progress line shows after the loss (e.g. DPO's ``rewards/accuracies``), TRL's names.
    headline_metrics: ClassVar[tuple[str, ...]] = ()

    def validate(self, config: Config) -> None:
        """Check what a user can get wrong before any process group, file or model exists (raise ConfigError)."""

    def build_models(self, context: RunContext) -> dict[str, ModelSpec]:
        """The models by name, built identically on every rank (the loop seeded every RNG with train.seed).

        The first trainable model is the primary one (its ``params_sha256`` is the run's).
        """
        raise NotImplementedError

    def build_dataset(self, context: RunContext) -> RecipeDataset:
        raise NotImplementedError

    def loss(self, models: Mapping[str, nn.Module], batch: Any) -> MicroBatchLoss:
        """The loss of one micro-batch. ``models`` are this rank's (parallelised) modules; call frozen ones
        under ``torch.no_grad()``. Runs under the loop's autocast and gradient-sync contexts."""
        raise NotImplementedError

    def prepare_step(self, micro_batches: list[Any], context: RunContext) -> list[Any]:
        """Once per optimizer step, after the step's ``grad_accum`` micro-batches are drawn (and moved to the
        device) and before the first forward: return the micro-batches to train on (RL recipes sample their
        rollouts here and all-reduce the step's statistics once). Every rank calls it, in step."""
        return micro_batches

    def after_optimizer_step(self, context: RunContext, step: int) -> None:
        """Once per optimizer step on every rank, after the optimizer (also a skipped non-finite step) and the
        LR schedule, before the plugins' ``crosstrain_after_optimizer_step`` hook; ``step`` is the step just
        completed (federated clients exchange their update here at the end of a round)."""

    def batch_tokens(self, batch: Any) -> tuple[torch.Tensor, int] | None:
        """``(real tokens, positions)`` of one micro-batch, for tokens/s and MFU; None: every position is a real
        token (``batch_size x seq_len`` a step). The default reads a dict batch's ``attention_mask`` (1: a token,
        0: padding), as the padded batches of transformers and the rlhf recipes carry it."""
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        if not isinstance(mask, torch.Tensor):
            return None
        return mask.sum(), mask.numel()

    def build_eval_dataset(self, context: RunContext) -> RecipeDataset | None:
        """Held-out samples for periodic evaluation (``[eval]``), or None for a recipe without evaluation."""
        return None

    def eval_loss(self, models: Mapping[str, nn.Module], batch: Any) -> MicroBatchLoss:
        """The loss (and metrics) of one eval batch; runs under ``torch.no_grad()`` with the models in eval mode.

        Defaults to :meth:`loss`; metrics are reported as ``eval/<name>``.
        """
        return self.loss(models, batch)

    def eval_metrics(self, means: Mapping[str, float]) -> dict[str, float]:
        """After an evaluation's batches, on every rank, in the loop and in ``crosstrain eval``: further metrics
        (``{"eval/<name>": value}``) added to ``means``, the averaged ``eval/<name>`` values of the whole held-out
        split. Either derived from them (ratios of averaged shares: ``classify``'s per-class precision and recall) or
        of the whole split and not a mean of per-batch values (``detect``'s COCO mAP: the recipe keeps what it needs
        in :meth:`eval_loss`, gathers it over data-parallel ranks and clears it here). The default has none."""
        return {}

    def eval_predictions(self, models: Mapping[str, nn.Module], batch: Any) -> list[dict[str, Any]] | None:
        """One JSON-ready dict per sample of an eval batch, in order (``crosstrain eval --predictions FILE``; runs
        like :meth:`eval_loss`): ``classify`` gives each image's label and top-1. None: this recipe has none."""
        return None

    def pipeline_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` that the pipeline schedule feeds its first and last stage."""
        raise NotImplementedError

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss the last pipeline stage computes from its output and the targets."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """Extra ``{key: Stateful}`` to checkpoint with the models (e.g. a running baseline)."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Extra keys for summary.json."""
        return {}

    def show_data(self, n: int) -> dict[str, Any]:
        """After :meth:`validate`: ``{"rows": [...], ...}``, the first ``n`` training rows exactly as the loss sees
        them, each with ``text``, ``input_ids`` and ``loss_mask``, plus what describes them (``source``,
        ``chat_template``) for ``crosstrain data show``. Recipes over token files have none to show."""
        from crosstrain.errors import ConfigError

        raise ConfigError(f"--recipe {self.name} reads token files, not rows; 'crosstrain data info FILE' describes "
                          "one (data show is for the JSONL recipes: sft, rm, dpo, grpo, ppo)")

    def data_split(self) -> dict[str, Any]:
        """How the data was split into training and validation parts; the loop writes it to data_split.json."""
        return {}


def builtin_recipes() -> dict[str, type[Recipe]]:
    from crosstrain.recipes.lm import LMRecipe

    return {LMRecipe.name: LMRecipe}


def recipe_names() -> list[str]:
    """Every recipe name known here: built-ins, then each plugin's ``recipe_names()`` if it lists them."""
    names = list(builtin_recipes())
    for _, listed in pluginmanager.call_each("crosstrain_recipe_names"):
        names += [n for n in (listed or []) if n not in names]
    return names


def resolve_recipe(name: str) -> Recipe:
    """The recipe called ``name`` (built-in first, then plugins); unknown names list the known ones."""
    builtin = builtin_recipes().get(name)
    if builtin is not None:
        return builtin()
    for plugin_name, found in pluginmanager.call_strict("crosstrain_recipe", "provide a recipe", name=name):
        if found is None:
            continue
        recipe = found() if isinstance(found, type) else found
        if not isinstance(recipe, Recipe):
            raise PluginError(f"plugin {plugin_name!r} returned {type(recipe).__name__} for recipe {name!r}, "
                              "not a crosstrain.engine.recipe.Recipe")
        return recipe
    raise ConfigError(f"train.recipe={name!r} is not a known recipe; known: {', '.join(recipe_names())} "
                      "(plugins add more; `crosstrain plugins` lists the loaded plugins and their recipes)")
