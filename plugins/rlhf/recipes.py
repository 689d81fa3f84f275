"""The ``sft``, ``rm`` and ``dpo`` recipes on the core Recipe API (docs/rlhf.md).

Each reads JSONL rows from ``data.path`` (held-out rows from ``data.val_path``, else the last
``data.val_fraction`` of the rows) or, with no ``data.path``, its embedded synthetic task
(:mod:`crosstrain.plugins.rlhf.synthetic`). ``model.init_from`` starts from trained weights (crosstrain.recipes.lm).
All three evaluate once before training as well (``eval_before`` / ``eval_after`` in summary.json).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from crosstrain.config import Config, gpt_config
from crosstrain.data import chat_template
from crosstrain.engine.recipe import MicroBatchLoss, ModelSpec, Recipe
from crosstrain.errors import ConfigError
from crosstrain.generation import GenerationConfig, generate
from crosstrain.models.family import swap_scalar_head
from crosstrain.plugins.rlhf import data as rdata
from crosstrain.plugins.rlhf import synthetic
from crosstrain.plugins.rlhf.lora import adapters_disabled
from crosstrain.plugins.rlhf.losses import (
    bradley_terry_loss,
    dpo_loss,
    preference_accuracy,
    sequence_logps,
    sft_loss,
    sft_token_loss,
    strict_accuracy,
    token_logps,
)
from crosstrain.recipes.lm import build_model, init_from_record


def _section(config: Config) -> Any:
    return config.section("rlhf")


def _split(rows: list[Any], fraction: float, path: str) -> tuple[list[Any], list[Any]]:
    n_val = max(1, math.ceil(fraction * len(rows)))
    if n_val >= len(rows):
        raise ConfigError(f"{path} has {len(rows)} rows: too few to hold out data.val_fraction={fraction}; "
                          "add rows or set data.val_path")
    return rows[:-n_val], rows[-n_val:]


class RLHFRecipe(Recipe):
    """What the three recipes share: data, tokenizer, limits, ``init_from`` and the summary."""

    kind = "sft"  # "sft" rows or "preference" rows
    eval_at_start = True  # the loop evaluates before the first step too (eval_before in summary.json)

    def __init__(self) -> None:
        self.dataset: Any = None
        self.eval_dataset: Any = None
        self.stats: dict[str, Any] = {}
        self.init_record: dict[str, Any] | None = None

    def validate(self, config: Config) -> None:
        from crosstrain.data.hf_tokenizer import load_tokenizer

        sec = _section(config)
        # pp, packing and head-vs-tp combinations: plugins/rlhf/rules.py, checked before any worker starts
        max_length = sec.max_length or config.train.seq_len
        if not config.model.import_path and max_length > gpt_config(config).max_seq_len + 1:
            raise ConfigError(f"rlhf.max_length={max_length} exceeds the model's max_seq_len+1; lower "
                              "rlhf.max_length (or train.seq_len) or raise model.max_seq_len")
        max_prompt = sec.max_prompt_length or max_length // 2
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        self.chat = chat_template.resolve(config.data.chat_template, config.data.tokenizer)
        parse = functools.partial(rdata.parse_sft_row if self.kind == "sft" else rdata.parse_preference_row,
                                  chat=self.chat)
        skipped = 0
        if config.data.path:
            rows, skipped = rdata.read_jsonl(config.data.path, parse, skip_bad_rows=config.data.skip_bad_rows)
            if config.data.val_path:
                val, s = rdata.read_jsonl(config.data.val_path, parse, skip_bad_rows=config.data.skip_bad_rows)
                skipped += s
            else:
                rows, val = _split(rows, config.data.val_fraction, config.data.path)
            source = config.data.path
        else:
            make = synthetic.sft_rows if self.kind == "sft" else synthetic.preference_rows
            rows, val = make(config.data.val_fraction or 0.05)
            source = f"embedded {self.kind} task (crosstrain.plugins.rlhf.synthetic)"
        encode = rdata.encode_sft if self.kind == "sft" else rdata.encode_preferences
        self.dataset = encode(self.tokenizer, rows, max_length, max_prompt)
        if self.kind == "preference":
            self.dataset.with_prompts = False  # only eval generates from the prompts
            rdata.check_ties(self.dataset, source)
        self.eval_dataset = encode(self.tokenizer, val, max_length, max_prompt)
        self.embedded = not config.data.path
        if not config.model.import_path and self.tokenizer.vocab_size > gpt_config(config).vocab_size:
            raise ConfigError(f"the tokenizer's vocabulary ({self.tokenizer.vocab_size}) is larger than "
                              f"model.vocab_size={gpt_config(config).vocab_size}; raise model.vocab_size")

        def truncated(ds: Any) -> int:
            if self.kind == "sft":
                return sum(r.truncated for r in ds.rows)
            return sum(c.truncated or r.truncated for c, r in ds.pairs)

        self.stats = {"source": source, "train_rows": len(self.dataset), "eval_rows": len(self.eval_dataset),
                      "skipped_rows": skipped, "truncated_rows": truncated(self.dataset) + truncated(self.eval_dataset),
                      "max_length": max_length, "max_prompt_length": max_prompt,
                      "chat_template": chat_template.describe(self.chat)}

    def show_data(self, n: int) -> dict[str, Any]:
        """The first ``n`` training rows as the loss sees them (``crosstrain data show``)."""
        if self.kind == "sft":
            rows = [rdata.show(self.tokenizer, row) for row in self.dataset.rows[:n]]
        else:
            rows = [{"chosen": rdata.show(self.tokenizer, c), "rejected": rdata.show(self.tokenizer, r)}
                    for c, r in self.dataset.pairs[:n]]
        return {"source": self.stats["source"], "chat_template": self.stats["chat_template"], "rows": rows}

    def build_dataset(self, context: Any) -> Any:
        if self.dataset is None:
            self.validate(context.config)
        return self.dataset

    def build_eval_dataset(self, context: Any) -> Any:
        self.build_dataset(context)
        return self.eval_dataset

    def data_split(self) -> dict[str, Any]:
        return {"rows": {"train": self.stats.get("train_rows"), "eval": self.stats.get("eval_rows")},
                "source": self.stats.get("source")}

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rlhf_data": self.stats}
        if self.init_record:
            out["init_from"] = self.init_record
        return out

    def _policy(self, context: Any) -> nn.Module:
        self.sec = _section(context.config)
        model = build_model(context.config)
        self.init_record = init_from_record(context.config, model)
        return model


def _shifted(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = batch["input_ids"]
    return ids[:, :-1], ids[:, 1:], batch["loss_mask"][:, 1:]


class SFTRecipe(RLHFRecipe):
    """``sft``: masked next-token loss over completion tokens only (:func:`losses.sft_loss`)."""

    name = "sft"
    loss_is_token_nll = True  # the mean NLL of each sequence's completion tokens

    def build_models(self, context: Any) -> dict[str, ModelSpec]:
        return {"policy": ModelSpec(self._policy(context))}

    def prepare_step(self, micro_batches: list[Any], context: Any) -> list[Any]:
        """``loss_normalization = "token"``: tag each micro-batch with ``sft_divisor``, the step's completion tokens
        over every micro-batch and data-parallel rank (one all-reduce, TRL's ``num_items_in_batch``) divided by the
        number of terms the loop averages (micro-batches x data-parallel ranks)."""
        if _section(context.config).loss_normalization != "token":
            return micro_batches
        import torch.distributed as dist

        from crosstrain.collective import global_sums
        from crosstrain.parallel import dp_rank_and_size

        _, dp = dp_rank_and_size(context.mesh, context.dims)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        local = torch.stack([mb["loss_mask"][:, 1:].sum() for mb in micro_batches]).sum()
        tokens = float(global_sums(local.reshape(1), max(1, world // dp))[0])  # tp/pp peers hold the same rows
        for mb in micro_batches:
            mb["sft_divisor"] = tokens / (len(micro_batches) * dp)
        return micro_batches

    def loss(self, models: Mapping[str, nn.Module], batch: Any) -> MicroBatchLoss:
        inputs, labels, mask = _shifted(batch)
        nll = -token_logps(models["policy"](inputs), labels)
        if self.sec.loss_normalization == "token":
            # training: the step's global count (prepare_step); eval: the micro-batch's own tokens, as TRL's
            # evaluation calls compute_loss without num_items_in_batch
            loss = sft_token_loss(nll, mask, batch.get("sft_divisor", mask.sum()))
        else:
            loss = sft_loss(nll, mask).mean()
        return MicroBatchLoss(loss, {"truncated": batch["truncated"].float().mean()})


class RewardRecipe(RLHFRecipe):
    """``rm``: the GPT with a scalar head (``output`` replaced by ``Linear(dim, 1)``) read at the last non-pad token,
    trained with the Bradley-Terry loss (:func:`losses.bradley_terry_loss`)."""

    name = "rm"
    kind = "preference"

    def build_models(self, context: Any) -> dict[str, ModelSpec]:
        model = self._policy(context)
        if getattr(getattr(model, "config", None), "tie_embeddings", False):  # (tp > 1: refused in rules.py)
            raise ConfigError("--recipe rm needs model.tie_embeddings=false (its scalar head replaces the LM head)")
        return {"reward": ModelSpec(swap_scalar_head(model, "normal", who="--recipe rm"))}

    def rewards(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        scores = model(batch["input_ids"])[..., 0].float()  # [2B, T]
        last = batch["attention_mask"].sum(-1) - 1
        r = scores.gather(1, last.unsqueeze(1)).squeeze(1)
        return r.chunk(2)  # type: ignore[return-value]

    def loss(self, models: Mapping[str, nn.Module], batch: Any) -> MicroBatchLoss:
        rc, rr = self.rewards(models["reward"], batch)
        loss = bradley_terry_loss(rc, rr, margin=self.sec.margin,
                                  center_coefficient=self.sec.center_rewards_coefficient).mean()
        return MicroBatchLoss(loss, {
            "accuracy": strict_accuracy(rc, rr).mean(), "margin": (rc - rr).mean().detach(),
            "rewards/chosen": rc.mean().detach(), "rewards/rejected": rr.mean().detach(),
            "truncated": batch["truncated"].float().mean()})


class DPORecipe(RLHFRecipe):
    """``dpo``: the policy and a frozen copy of its starting weights as the reference (sharded like the policy,
    no gradients), or under ``[lora]`` the policy with its adapters off; the DPO family of losses
    (:func:`losses.dpo_loss`), metrics under TRL's names."""

    name = "dpo"
    kind = "preference"
    headline_metrics = ("rewards/accuracies", "rewards/margins")

    def validate(self, config: Config) -> None:
        sec = _section(config)
        if sec.loss_type == "sigmoid" and sec.label_smoothing:
            # TRL 1.16's sigmoid silently ignores label_smoothing: a copied TRL config must not train another loss
            raise ConfigError(f"rlhf.label_smoothing={sec.label_smoothing} has no effect on rlhf.loss_type=sigmoid "
                              "(TRL ignores it too); set rlhf.loss_type=cdpo (conservative DPO) or robust, or "
                              "rlhf.label_smoothing=0")
        super().validate(config)

    def build_models(self, context: Any) -> dict[str, ModelSpec]:
        policy = self._policy(context)
        if self.sec.reference == "precomputed":  # one pass before the first batch, cached; no reference model
            from crosstrain.plugins.rlhf.reference_cache import PrecomputedReference

            if self.dataset is None:
                self.validate(context.config)
            cfg = context.config
            options = {"max_length": self.stats["max_length"], "max_prompt_length": self.stats["max_prompt_length"],
                       "tokenizer": cfg.data.tokenizer, "precision": cfg.precision.dtype,
                       "model": cfg.model.model_dump(exclude={"init_from"}, mode="json")}
            self.reference = PrecomputedReference(context, policy, {"train": self.dataset, "eval": self.eval_dataset},
                                                  options)
            return {"policy": ModelSpec(policy)}
        if context.config.section("lora").rank:  # the reference is the policy with its adapters off
            return {"policy": ModelSpec(policy)}
        reference = copy.deepcopy(policy)
        source = (f"model.init_from {self.init_record['source']}" if self.init_record
                  else f"initial weights (train.seed={context.config.train.seed})")
        # transform=True: the plugins' transforms (MoE layers) build the policy's copy, so the two start equal
        return {"policy": ModelSpec(policy),
                "reference": ModelSpec(reference, trainable=False, source=source, transform=True)}

    def _logps(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels, mask = _shifted(batch)
        return sequence_logps(model(inputs), labels, mask)

    def _pair_loss(self, models: Mapping[str, nn.Module], batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        logps, lengths = self._logps(models["policy"], batch)
        with torch.no_grad():
            if "reference_logps" in batch:
                ref_logps = batch["reference_logps"]
            elif "reference" in models:
                ref_logps, _ = self._logps(models["reference"], batch)
            else:
                with adapters_disabled(models["policy"]):
                    ref_logps, _ = self._logps(models["policy"], batch)
        pc, pr = logps.chunk(2)
        rc, rr = ref_logps.chunk(2)
        cl, rl = lengths.chunk(2)
        losses, chosen, rejected = dpo_loss(pc, pr, rc, rr, cl, rl, beta=self.sec.beta, loss_type=self.sec.loss_type,
                                            label_smoothing=self.sec.label_smoothing)
        metrics = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
                   "rewards/accuracies": strict_accuracy(chosen, rejected).mean(),
                   "rewards/margins": (chosen - rejected).mean(),
                   "logps/chosen": pc.detach().mean(), "logps/rejected": pr.detach().mean(),
                   "preference_accuracy": preference_accuracy(chosen, rejected).mean(),
                   "truncated": batch["truncated"].float().mean()}
        return losses.mean(), metrics

    reference: Any = None  # a PrecomputedReference under rlhf.reference="precomputed"

    def state(self) -> dict[str, Any]:
        from crosstrain.plugins.rlhf.reference_cache import ReferenceChecksum

        return {"rlhf_reference": ReferenceChecksum(self.reference)} if self.reference is not None else {}

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        if self.reference is not None and self.reference.checksum:
            out["reference_logps_sha256"] = self.reference.checksum
        return out

    def loss(self, models: Mapping[str, nn.Module], batch: Any) -> MicroBatchLoss:
        loss, metrics = self._pair_loss(models, batch)
        return MicroBatchLoss(loss, metrics)

    def eval_loss(self, models: Mapping[str, nn.Module], batch: Any) -> MicroBatchLoss:
        loss, metrics = self._pair_loss(models, batch)
        if self.embedded:  # the trait is known only for the embedded task
            texts = greedy_completions(models["policy"], batch["prompt_ids"], batch["prompt_lengths"],
                                       self.sec.max_new_tokens, self.tokenizer)
            metrics["win_rate"] = sum(synthetic.shows_trait(t) for t in texts) / len(texts)
        return MicroBatchLoss(loss, metrics)


def greedy_completions(model: nn.Module, prompts: torch.Tensor, lengths: torch.Tensor, new_tokens: int,
                       tokenizer: Any) -> list[str]:
    """Greedy continuations of right-padded ``prompts [B, P]`` (true ``lengths [B]``), ``new_tokens`` each, decoded.

    Decoded by :func:`crosstrain.generation.generate` (KV cache, one forward per new token; sharded models are
    gathered once per call). No stop token: every rank runs the same number of forwards.
    """
    rows = [row[:n] for row, n in zip(prompts.tolist(), lengths.tolist(), strict=True)]
    out = generate(model, rows, GenerationConfig(max_new_tokens=new_tokens, greedy=True))
    return [tokenizer.decode(np.asarray(row, dtype=np.int64)) for row in out.tokens.tolist()]


RECIPES: dict[str, type[Recipe]] = {"sft": SFTRecipe, "rm": RewardRecipe, "dpo": DPORecipe}
