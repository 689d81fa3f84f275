"""What ``grpo`` and ``ppo`` share: prompts, rollouts, rewards, the reference model, step-level global statistics,
the policy loss, diagnostics, eval and checkpointed state.

How a step runs in the loop (docs/recipes.md states the loop's order): the training dataset's ``batch()`` gives
the prompt indices of each of the step's ``grad_accum`` micro-batches; :meth:`RLRecipe.prepare_step` (once per
step, before the first forward) samples every micro-batch's completions from the current policy, all-reduces
the rollouts' sums (tokens, sequences, reward moments, ...) once, and tags each micro-batch with the step's
global statistics and its position in the step; every micro-batch's :meth:`RLRecipe.loss` is then its share of
the global batch's loss (:mod:`.aggregate`), and :meth:`RLRecipe.after_optimizer_step` updates the adaptive KL
coefficient. As in TRL, ``train.batch_size`` counts completions: a micro-batch of ``B`` sampled indices takes its
first ``B / G`` prompts and samples ``G`` completions of each. One optimizer step per rollout batch (on-policy;
pi_old = the rollout's log-probs, so the ratio is 1 up to the rollout-vs-training numerical difference, which is
reported).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from crosstrain.collective import all_reduce_served, global_sums
from crosstrain.config import Config, gpt_config
from crosstrain.data import chat_template
from crosstrain.engine.recipe import MicroBatchLoss, ModelSpec, Recipe
from crosstrain.errors import ConfigError
from crosstrain.generation import GenerationConfig, generate
from crosstrain.models.family import swap_scalar_head
from crosstrain.plugins.rlhf.data import Rendered, encode_prompt
from crosstrain.plugins.rlhf.rl import tasks
from crosstrain.plugins.rlhf.rl.aggregate import aggregate
from crosstrain.plugins.rlhf.rl.kl import AdaptiveKLController, kl_estimate
from crosstrain.plugins.rlhf.rl.policy_loss import clipped_surrogate, log_ratio
from crosstrain.plugins.rlhf.rl.rollout import (
    Packed,
    SamplingRNG,
    completion_logits,
    completion_texts,
    pack,
    prompt_noise,
    sample,
)
from crosstrain.recipes.lm import build_model, init_from_record, load_crosstrain_weights

# the step-level sums every rollout micro-batch contributes (all-reduced once per step)
SUMS = ("tokens", "sequences", "reward", "reward_sq", "zero_std_groups", "groups", "kl", "adv", "adv_sq",
        "stopped")


class PromptDataset:
    """Prompt indices: a batch is ``{"prompt_index": [B]}``; the recipe's ``prepare_step`` turns a training
    step's batches into rollouts."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def batch(self, indices: Any) -> dict[str, torch.Tensor]:
        return {"prompt_index": torch.tensor([int(i) for i in np.asarray(indices).reshape(-1)])}


def scalar_head_gpt(config: Config) -> nn.Module:
    """The built-in GPT with its LM head replaced by ``Linear(dim, 1)`` (the rm recipe's reward model shape)."""
    from crosstrain.models.gpt import GPT

    return swap_scalar_head(GPT(gpt_config(config)), "default", who="reward.model")


class RLRecipe(Recipe):
    """Base of ``grpo`` and ``ppo``; subclasses set :meth:`advantages` (and extra models and losses)."""

    eval_at_start = True
    _max = 0.0  # the running maximum of the step's rollout-vs-training log-prob difference

    def validate(self, config: Config) -> None:
        from crosstrain.data.hf_tokenizer import load_tokenizer

        sec, rew = config.section("rl"), config.section("reward")
        # pp and [lora]: refused before any worker starts (the core's pp-recipe rule, plugins/rlhf/rules.py)
        if config.model.import_path:
            raise ConfigError(f"--recipe {self.name} needs the built-in GPT (generation and value/reward heads); "
                              "unset model.import_path")
        if rew.fn and rew.model:
            raise ConfigError("set reward.fn or reward.model, not both")
        if sec.kl_target and not sec.beta:
            raise ConfigError("rl.kl_target adapts rl.beta multiplicatively and needs rl.beta > 0; set rl.beta")
        if sec.dual_clip and sec.dual_clip <= 1:
            raise ConfigError(f"rl.dual_clip={sec.dual_clip} must be > 1 (or 0 = off)")
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        stop = self.tokenizer.encode(sec.stop) if sec.stop else np.zeros(0, dtype=np.int64)
        if len(stop) > 1:
            raise ConfigError(f"rl.stop={sec.stop!r} is {len(stop)} tokens; use a single-token stop string")
        from crosstrain.generation.stops import stop_tokens

        # rl.stop's token joins the tokenizer's / model folder's own stop set (EOS, end-of-turn, generation_config)
        self.stop_tokens = stop_tokens(config.data.tokenizer, config.model.init_from or None,
                                       extra=tuple(int(t) for t in stop))
        max_prompt = gpt_config(config).max_seq_len - sec.max_new_tokens
        if max_prompt < 1:
            raise ConfigError(f"rl.max_new_tokens={sec.max_new_tokens} leaves no room for a prompt in "
                              f"model.max_seq_len={gpt_config(config).max_seq_len}; lower it or raise max_seq_len")
        skipped = 0
        self.chat = chat_template.resolve(config.data.chat_template, config.data.tokenizer)
        train: list[str | Rendered]
        val: list[str | Rendered]
        if config.data.path:
            train, skipped = tasks.read_prompts(config.data.path, config.data.skip_bad_rows, self.chat)
            if config.data.val_path:
                val, s = tasks.read_prompts(config.data.val_path, config.data.skip_bad_rows, self.chat)
                skipped += s
            else:
                n_val = max(1, math.ceil(config.data.val_fraction * len(train)))
                if n_val >= len(train):
                    raise ConfigError(f"{config.data.path} has {len(train)} prompts: too few to hold out "
                                      "data.val_fraction of them; add rows or set data.val_path")
                train, val = train[:-n_val], train[-n_val:]
            source = config.data.path
        else:
            train, val = tasks.embedded_prompts(config.data.val_fraction or 0.05)  # type: ignore[assignment]
            source = "embedded vowel task (crosstrain.plugins.rlhf.rl.tasks)"
        self.prompt_text = {split: [p.text if isinstance(p, Rendered) else p for p in rows]
                            for split, rows in (("train", train), ("eval", val))}
        truncated = 0
        self.prompts: dict[str, list[np.ndarray]] = {}
        for split, rows in (("train", train), ("eval", val)):
            enc = [encode_prompt(self.tokenizer, p) for p in rows]
            truncated += sum(len(e) > max_prompt for e in enc)
            self.prompts[split] = [e[-max_prompt:] for e in enc]
        if any(len(p) == 0 for ps in self.prompts.values() for p in ps):
            raise ConfigError(f"{source} has an empty prompt; drop it (every prompt needs a token)")
        if self.tokenizer.vocab_size > gpt_config(config).vocab_size:
            raise ConfigError(f"the tokenizer's vocabulary ({self.tokenizer.vocab_size}) is larger than "
                              f"model.vocab_size={gpt_config(config).vocab_size}; raise model.vocab_size")
        self.reward_fn = tasks.load_reward_fn(rew.fn) if rew.fn else None
        self.stats = {"source": source, "train_prompts": len(train), "eval_prompts": len(val),
                      "skipped_rows": skipped, "truncated_prompts": int(truncated),
                      "chat_template": chat_template.describe(self.chat)}
        self.validate_loss(config)

    def validate_loss(self, config: Config) -> None:
        """Checks of the subclass's own options."""

    # ------------------------------------------------------------------ models, data, state
    def build_models(self, context: Any) -> dict[str, ModelSpec]:
        cfg = context.config
        if not hasattr(self, "prompts"):
            self.validate(cfg)
        self.sec, self.rew = cfg.section("rl"), cfg.section("reward")
        policy = build_model(cfg)
        self.init_record = init_from_record(cfg, policy)
        models = {"policy": ModelSpec(policy)}
        models.update(self.extra_models(cfg, policy))
        if self.sec.beta:
            source = (f"model.init_from {self.init_record['source']}" if self.init_record
                      else f"initial weights (train.seed={cfg.train.seed})")
            # transform=True: transformed like the policy (the same MoE experts), so the two start equal
            models["reference"] = ModelSpec(copy.deepcopy(policy), trainable=False, source=source, transform=True)
        if self.rew.model:
            rm = scalar_head_gpt(cfg)
            load_crosstrain_weights(rm, self.rew.model, what="reward.model")
            models["reward"] = ModelSpec(rm, trainable=False, source=f"reward.model {self.rew.model}")
        from crosstrain.parallel import dp_rank_and_size

        dp_rank, dp_size = dp_rank_and_size(context.mesh, context.dims)
        self.configure(cfg, dp_rank, dp_size, context.world_size)
        return models

    def configure(self, config: Config, dp_rank: int, dp_size: int, world_size: int) -> None:
        """Step bookkeeping for this rank's place in the layout (build_models calls it; so can a test)."""
        self.sec, self.rew = config.section("rl"), config.section("reward")
        self.rng = SamplingRNG(config.train.seed)
        self.kl_ctl = AdaptiveKLController(self.sec.beta, self.sec.kl_target, self.sec.kl_horizon)
        self.grad_accum = config.train.grad_accum
        # a micro-batch holds whole groups of completions: refused otherwise (rl-groups, plugins/rlhf/rules.py)
        self.dp_rank, self.dp = dp_rank, dp_size
        self.copies = max(1, world_size // dp_size)  # ranks holding the same data (tp peers)
        self.gen_config = GenerationConfig(max_new_tokens=self.sec.max_new_tokens, stop_tokens=self.stop_tokens)
        # rows padded to one width for the run: a micro-batch's padding (which MoE routers count) then does not
        # depend on which prompts share it
        self.width = max(len(p) for p in self.prompts["train"]) + self.sec.max_new_tokens
        self.step_stats: dict[str, float] | None = None  # the step's global sums, from prepare_step

    def extra_models(self, config: Config, policy: nn.Module) -> dict[str, ModelSpec]:
        return {}

    def build_dataset(self, context: Any) -> Any:
        self.context = context
        return PromptDataset(len(self.prompts["train"]))

    def build_eval_dataset(self, context: Any) -> Any:
        return PromptDataset(len(self.prompts["eval"]))

    def state(self) -> dict[str, Any]:
        return {"rl_sampling_rng": self.rng, "rl_kl_controller": self.kl_ctl}

    def data_split(self) -> dict[str, Any]:
        return {"prompts": {"train": self.stats["train_prompts"], "eval": self.stats["eval_prompts"]},
                "source": self.stats["source"]}

    def show_data(self, n: int) -> dict[str, Any]:
        """The first ``n`` training prompts as generation sees them (``crosstrain data show``); the loss trains on
        the sampled completions, so no prompt token is in it."""
        rows = [{"text": self.tokenizer.decode(p), "input_ids": [int(i) for i in p], "loss_mask": [0] * len(p)}
                for p in self.prompts["train"][:n]]
        return {"source": self.stats["source"], "chat_template": self.stats["chat_template"], "rows": rows}

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rl_data": self.stats, "rl": {"beta_final": self.kl_ctl.beta}}
        if self.init_record:
            out["init_from"] = self.init_record
        return out

    # ------------------------------------------------------------------ rollouts
    @property
    def group(self) -> int:
        return int(self.sec.num_generations)

    def score(self, packed: Packed, indices: list[int], split: str, group: int) -> torch.Tensor:
        """Rewards ``[R]``: ``reward.fn``, the reward model at each row's last token, or the embedded task."""
        device = packed.ids.device
        if self.rew.model:
            scores = self.context.models["reward"](packed.ids)[..., 0].float()
            return scores.gather(1, packed.ends.unsqueeze(1)).squeeze(1)
        texts = completion_texts(packed.tokens, packed.mask, packed.stopped, self.tokenizer)
        prompts = [self.prompt_text[split][i] for i in indices for _ in range(group)]
        if self.reward_fn is not None:
            # training rollouts score the step in progress; evaluation the steps done so far
            where = f"step {self.context.step + 1}" if split == "train" else f"the eval after step {self.context.step}"
            values = tasks.call_reward_fn(self.reward_fn, self.rew.fn, texts, prompts, where)
        else:
            values = tasks.vowel_fraction(texts, prompts)
        return torch.tensor(values, dtype=torch.float32, device=device)

    def prepare_step(self, micro_batches: list[Any], context: Any) -> list[dict[str, Any]]:
        """The step's rollouts: one sampling seed for the step, every micro-batch sampled, scored and precomputed
        from the current policy, their sums all-reduced once, and each tagged with the step's global statistics
        (``rl_stats``) and its position in the step (``rl_micro``)."""
        seed = self.rng.next_seed()
        return self.tag([self.rollout([int(i) for i in mb["prompt_index"].tolist()], seed) for mb in micro_batches])

    def tag(self, rollouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Pop each rollout's local ``rl_sums``, sum them over the step's micro-batches and the data-parallel ranks
        (one all-reduce) and tag every rollout with the result and its index; kept for :meth:`after_optimizer_step`."""
        local = torch.stack([r.pop("rl_sums") for r in rollouts]).sum(0)
        self.step_stats = dict(zip(SUMS, global_sums(local, self.copies).tolist(), strict=True))
        for j, r in enumerate(rollouts):
            r["rl_stats"], r["rl_micro"] = self.step_stats, j
        return rollouts

    def after_optimizer_step(self, context: Any, step: int) -> None:
        """The adaptive KL controller sees the step's per-sequence KL (as TRL's), for the next step's rollouts."""
        g, self.step_stats = self.step_stats, None
        if g is not None:
            n = g["sequences"]
            self.kl_ctl.update(g["kl"] / max(n, 1), int(n))

    @torch.no_grad()
    def rollout(self, indices: list[int], step_seed: int) -> dict[str, Any]:
        """Sample, score and precompute one training micro-batch; its local sums are ``rl_sums`` (:data:`SUMS`)."""
        models = self.context.models
        # the batch counts completions: B / G prompts, G each; every G-th of the step's samples (a micro-batch
        # starts at a multiple of G), so the step's prompts, and each micro-batch's over all ranks, do not
        # depend on the layout
        indices = indices[:: self.group]
        noise = prompt_noise(step_seed, indices, self.group, self.gen_config.max_new_tokens)
        packed = sample(models["policy"], [self.prompts["train"][i] for i in indices], self.group, self.gen_config,
                        noise, self.width)
        mask = packed.mask
        batch: dict[str, Any] = {"ids": packed.ids, "index": packed.index, "tokens": packed.tokens, "mask": mask,
                                 "rollout_logps": packed.logprobs}
        scores = self.score(packed, indices, "train", self.group)
        kl = torch.zeros_like(packed.logprobs)
        if "reference" in models:
            ref = completion_logits(models["reference"], packed.ids, packed.index).float().log_softmax(-1)
            batch["ref_logps"] = ref.gather(-1, packed.tokens.unsqueeze(-1)).squeeze(-1)
            kl = kl_estimate(packed.logprobs, batch["ref_logps"], self.sec.kl_estimator, self.sec.kl_clamp) * mask
        batch["scores"] = scores
        m = mask.double()
        groups = scores.double().view(-1, self.group)
        zero_std = (groups.max(1).values == groups.min(1).values).sum()
        sums = {"tokens": m.sum(), "sequences": float(len(scores)), "reward": scores.double().sum(),
                "reward_sq": (scores.double() ** 2).sum(), "zero_std_groups": zero_std, "groups": groups.shape[0],
                "kl": kl.double().sum(), "stopped": packed.stopped.double().sum()}
        batch.update(self.prepare(models, packed, scores, kl, sums))
        batch["rl_sums"] = torch.tensor([float(sums.get(k, 0.0)) for k in SUMS], dtype=torch.float64)
        return batch

    def prepare(self, models: Mapping[str, nn.Module], packed: Packed, scores: torch.Tensor, kl: torch.Tensor,
                sums: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Subclass hook at rollout time (no grad): extra batch tensors, extra ``sums``."""
        return {}

    # ------------------------------------------------------------------ the loss
    def advantages(self, batch: Mapping[str, torch.Tensor], g: dict[str, float]) -> torch.Tensor:
        raise NotImplementedError

    def extra_loss(self, models: Mapping[str, nn.Module], batch: Mapping[str, torch.Tensor], g: dict[str, float],
                   terms: int) -> tuple[torch.Tensor, dict[str, Any]]:
        return torch.zeros(()), {}

    def loss(self, models: Mapping[str, nn.Module], batch: Any) -> MicroBatchLoss:
        sec = self.sec
        g, j, terms = batch["rl_stats"], batch["rl_micro"], self.grad_accum * self.dp
        mask, tokens = batch["mask"], batch["tokens"]
        logits = completion_logits(models["policy"], batch["ids"], batch["index"]).float()
        logp_all = logits.log_softmax(-1)
        logps = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        adv = self.advantages(batch, g)
        ratio = log_ratio(logps, batch["rollout_logps"], mask, sec.importance_sampling_level)
        sur = clipped_surrogate(ratio, adv, sec.epsilon, sec.epsilon_high, sec.dual_clip)
        per_token = sur.loss
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        if sec.beta and sec.kl_in == "loss":
            per_token = per_token + self.kl_ctl.beta * kl_estimate(logps, batch["ref_logps"], sec.kl_estimator,
                                                                   sec.kl_clamp)
        if sec.entropy_coef:
            per_token = per_token - sec.entropy_coef * entropy
        agg = dict(tokens=g["tokens"], sequences=g["sequences"], max_tokens=sec.max_new_tokens)
        policy_loss = aggregate(per_token, mask, sec.aggregation, **agg) * terms
        extra, extra_metrics = self.extra_loss(models, batch, g, terms)
        loss = policy_loss + extra

        def token_mean(x: torch.Tensor) -> torch.Tensor:  # this micro-batch's share of the global token mean
            return aggregate(x.detach().float(), mask, "token-mean", tokens=g["tokens"], sequences=1) * terms

        diff = (logps.detach() - batch["rollout_logps"]).abs() * mask
        n, mean = g["sequences"], g["reward"] / max(g["sequences"], 1)
        var = max(g["reward_sq"] - n * mean * mean, 0.0) / max(n - 1, 1)
        metrics: dict[str, Any] = {
            "reward": mean, "reward_std": math.sqrt(var),
            "frac_reward_zero_std": g["zero_std_groups"] / max(g["groups"], 1),
            "completions/mean_length": g["tokens"] / max(n, 1),
            "completions/clipped_ratio": 1.0 - g["stopped"] / max(n, 1),
            "entropy": token_mean(entropy), "loss/policy": policy_loss.detach(),
            "clip_ratio/low_mean": token_mean(sur.clipped_low), "clip_ratio/high_mean": token_mean(sur.clipped_high),
            "clip_ratio/region_mean": token_mean(sur.clipped_low | sur.clipped_high),
            "clip_ratio/dual_mean": token_mean(sur.dual_clipped),
            "rollout_logprob_diff/mean_abs": token_mean(diff),
            "rollout_logprob_diff/max": self._step_max(float(diff.max()) if diff.numel() else 0.0, j),
            **extra_metrics}
        if sec.beta:
            metrics["kl"] = g["kl"] / max(g["tokens"], 1)
            metrics["beta"] = self.kl_ctl.beta
        return MicroBatchLoss(loss, metrics)

    def _step_max(self, value: float, j: int) -> float:
        """The step's maximum over micro-batches and ranks, reported so that the loop's mean over both is it:
        ``max * grad_accum`` on the last micro-batch, 0 on the others (one small all-reduce per step)."""
        self._max = value if j == 0 else max(self._max, value)
        if j < self.grad_accum - 1:
            return 0.0
        top = torch.tensor([self._max])
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            top = all_reduce_served(top, dist.ReduceOp.MAX)
        return float(top) * self.grad_accum

    # ------------------------------------------------------------------ eval
    def eval_loss(self, models: Mapping[str, nn.Module], batch: Any) -> MicroBatchLoss:
        """Greedy completions of held-out prompts: ``reward_mean``, the task's ``reward_max`` (``reward.max``),
        ``completion_length``; the eval loss is ``-reward_mean``."""
        indices = [int(i) for i in batch["prompt_index"].tolist()]
        prompts = [self.prompts["eval"][i].tolist() for i in indices]
        cfg = GenerationConfig(max_new_tokens=self.sec.max_new_tokens, greedy=True, stop_tokens=self.stop_tokens)
        out = generate(models["policy"], prompts, cfg)
        packed = pack(out, prompts, cfg)
        scores = self.score(packed, indices, "eval", 1)
        mean = scores.mean()
        return MicroBatchLoss(-mean, {"reward_mean": mean, "reward_max": float(self.rew.max),
                                      "completion_length": out.lengths.float().mean()})
