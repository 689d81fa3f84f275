"""``--recipe distill``: a student learns from a frozen teacher's token distributions and from the labels.

Per micro-batch: ``loss = alpha * T^2 * D(teacher || student) + (1 - alpha) * NLL(labels)`` over the tokens that
count (all of plain text; the completion of prompt/completion rows), ``D`` the ``distill.loss`` divergence
(:mod:`.losses`). On-policy micro-batches (``distill.on_policy``, :mod:`.onpolicy`) train on the divergence alone:
their labels are the student's own samples. The teacher is a frozen model of the run (sharded for inference by the
loop, recorded by source and SHA-256, a changed one refused on resume), or its top-k log-probs read from
``distill.cache``. Evaluation reports the student's and the teacher's NLL side by side (``eval/nll/student``,
``eval/nll/teacher``) and the divergence (``eval/kd``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from crosstrain.config import Config, gpt_config
from crosstrain.engine.recipe import MicroBatchLoss, ModelSpec, Recipe
from crosstrain.errors import ConfigError
from crosstrain.plugins.compress.distill import data as ddata
from crosstrain.plugins.compress.distill.data import DistillBatch
from crosstrain.plugins.compress.distill.losses import TopK, distill_loss, masked_nll
from crosstrain.plugins.compress.distill.teacher import check_source, load_teacher, record
from crosstrain.recipes.lm import build_model, init_from_record


class DistillRecipe(Recipe):
    """Knowledge distillation (module docstring); models ``student`` (trainable, the primary) and ``teacher``."""

    name = "distill"
    loss_is_token_nll = False  # a mix of divergence and NLL; eval/nll/student is the student's NLL

    def __init__(self) -> None:
        self.dataset: ddata.DistillDataset | None = None
        self.eval_dataset: ddata.DistillDataset | None = None
        self.split: dict[str, Any] = {}
        self.cache: Any = None  # a cache.Cache with distill.cache
        self.teacher_record: dict[str, Any] | None = None
        self.init_record: dict[str, Any] | None = None
        self.sampled_batches = 0

    def validate(self, config: Config) -> None:
        self.sec = sec = config.section("distill")
        if sec.cache:
            if sec.on_policy > 0:
                raise ConfigError("distill.on_policy > 0 needs the teacher running on the student's samples; unset "
                                  "distill.cache and set distill.teacher")
            from crosstrain.plugins.compress.distill.cache import Cache

            self.cache = Cache(sec.cache)
        if sec.teacher or not sec.cache:  # beside a cache, the teacher names whose output the cache must hold
            check_source(sec.teacher)
        if sec.on_policy > 0 and config.parallel.pp > 1:
            raise ConfigError("distill.on_policy > 0 cannot sample from a pipeline stage; set parallel.pp=1")
        self.dataset, self.eval_dataset, self.split = ddata.build(config)  # the data's checks, tokenizer included
        vocab = gpt_config(config).vocab_size
        if sec.top_k_logits > vocab:  # torch.topk would fail in the first step, after the run dir exists
            raise ConfigError(f"distill.top_k_logits={sec.top_k_logits} exceeds the vocabulary of {vocab} tokens; set "
                              f"distill.top_k_logits <= {vocab} (0 = the whole vocabulary)")
        if self.cache is not None:
            self._attach_cache(config, vocab)

    def _attach_cache(self, config: Config, vocab: int) -> None:
        assert self.dataset is not None
        splits = {"train": self.dataset, **({"eval": self.eval_dataset} if self.eval_dataset is not None else {})}
        self.cache.check(ddata.fingerprint(splits), self.sec.loss_temperature, vocab)
        if self.sec.teacher:  # loaded only to hash its weights; the run reads the cache
            teacher = load_teacher(self.sec.teacher, vocab)
            self.cache.check_teacher(teacher.source, teacher.sha256)
        k = int(self.cache.meta["top_k"])
        if self.sec.top_k_logits > k:
            raise ConfigError(f"distill.top_k_logits={self.sec.top_k_logits} exceeds the {k} tokens per position "
                              f"distill.cache holds; set distill.top_k_logits <= {k} (0 = all {k})")
        for name, ds in splits.items():
            ds.cache = self.cache.split(name)

    def build_models(self, context: Any) -> dict[str, ModelSpec]:
        cfg = context.config
        student = build_model(cfg)
        self.init_record = init_from_record(cfg, student)
        specs = {"student": ModelSpec(student)}
        if self.cache is not None:
            self.teacher_record = self.cache.record()
            return specs
        vocab = int(getattr(getattr(student, "config", None), "vocab_size", 0) or gpt_config(cfg).vocab_size)
        teacher = load_teacher(self.sec.teacher, vocab)
        self.teacher_record = record(teacher)
        specs["teacher"] = ModelSpec(teacher.model, trainable=False, source=teacher.source)
        return specs

    def build_dataset(self, context: Any) -> ddata.DistillDataset:
        if self.dataset is None:
            self.validate(context.config)
        assert self.dataset is not None
        return self.dataset

    def build_eval_dataset(self, context: Any) -> ddata.DistillDataset | None:
        self.build_dataset(context)
        return self.eval_dataset

    def data_split(self) -> dict[str, Any]:
        return self.split

    def prepare_step(self, micro_batches: list[Any], context: Any) -> list[Any]:
        if self.sec.on_policy <= 0:
            return micro_batches
        from crosstrain.parallel import dp_rank_and_size
        from crosstrain.plugins.compress.distill.onpolicy import is_on_policy, sample_completions

        seed, step = context.config.train.seed, context.step
        dp_rank, _ = dp_rank_and_size(context.mesh, context.dims)
        student = context.models["student"]
        max_len = int(getattr(getattr(student, "config", None), "max_seq_len", 0) or gpt_config(context.config)
                      .max_seq_len)
        out = []
        for i, batch in enumerate(micro_batches):
            if is_on_policy(self.sec.on_policy, seed, step, i):
                gen = torch.Generator(device=batch.inputs.device).manual_seed(hash((seed, step, i, dp_rank)) % 2**62)
                batch = sample_completions(student, batch, temperature=self.sec.sample_temperature,
                                           max_seq_len=max_len, generator=gen,
                                           stop_tokens=self.stop_set(context.config))
                batch.sampled = True
                self.sampled_batches += 1
            out.append(batch)
        return out

    def stop_set(self, config: Config) -> tuple[int, ...]:
        """The student's stop tokens (:func:`crosstrain.generation.stops.stop_tokens`), derived once."""
        if not hasattr(self, "_stops"):
            from crosstrain.generation.stops import stop_tokens

            self._stops = stop_tokens(config.data.tokenizer, config.model.init_from or None)
        return self._stops

    def _teacher(self, models: Mapping[str, nn.Module], batch: DistillBatch) -> torch.Tensor | TopK:
        if batch.teacher_ids is not None and batch.teacher_logps is not None:
            k = self.sec.top_k_logits or batch.teacher_ids.shape[-1]
            return TopK(batch.teacher_ids[..., :k], batch.teacher_logps[..., :k])
        with torch.no_grad():
            return models["teacher"](batch.inputs, **batch.model_kwargs())

    def _losses(self, models: Mapping[str, nn.Module], batch: DistillBatch) -> tuple[torch.Tensor, dict[str, Any],
                                                                                       torch.Tensor | TopK]:
        sec = self.sec
        logits = models["student"](batch.inputs, **batch.model_kwargs())
        teacher = self._teacher(models, batch)
        nll = masked_nll(logits, batch.targets, batch.mask)
        kd = distill_loss(logits, teacher, batch.mask, loss=sec.loss, beta=sec.beta, temperature=sec.loss_temperature,
                          top_k=sec.top_k_logits if isinstance(teacher, torch.Tensor) else 0,
                          chunk_tokens=sec.chunk_tokens)
        alpha = 1.0 if batch.sampled else sec.alpha  # the labels of a sampled batch are the student's own tokens
        loss = alpha * kd + (1.0 - alpha) * nll
        return loss, {"kd": kd.detach(), "nll/student": nll.detach(), "on_policy": float(batch.sampled)}, teacher

    def loss(self, models: Mapping[str, nn.Module], batch: DistillBatch) -> MicroBatchLoss:
        loss, metrics, _ = self._losses(models, batch)
        return MicroBatchLoss(loss, metrics)

    def eval_loss(self, models: Mapping[str, nn.Module], batch: DistillBatch) -> MicroBatchLoss:
        loss, metrics, teacher = self._losses(models, batch)
        if isinstance(teacher, torch.Tensor):
            metrics["nll/teacher"] = masked_nll(teacher, batch.targets, batch.mask)
        else:
            assert batch.teacher_nll is not None
            weights = batch.mask.float()
            metrics["nll/teacher"] = (batch.teacher_nll * weights).sum() / weights.sum().clamp_min(1.0)
        del metrics["on_policy"]
        return MicroBatchLoss(loss, metrics)

    def state(self) -> dict[str, Any]:
        if self.cache is None:
            return {}
        from crosstrain.plugins.compress.distill.cache import CacheChecksum

        return {"distill_cache": CacheChecksum(self.cache)}

    def summary(self) -> dict[str, Any]:
        sec = self.sec
        out: dict[str, Any] = {"distill": {
            "teacher": self.teacher_record, "loss": sec.loss, "beta": sec.beta,
            "loss_temperature": sec.loss_temperature, "alpha": sec.alpha, "top_k_logits": sec.top_k_logits,
            "on_policy": sec.on_policy, "data": sec.data,
            "sampled_micro_batches": self.sampled_batches}}
        if self.init_record:
            out["init_from"] = self.init_record
        return out
