"""The grpo loss is the loss of the global batch whatever the layout: loss and gradients equal on 1 vs 2 ranks
(gloo, real processes) and for grad_accum 1 vs 4, for every aggregation mode (fp32, 1e-5).

The rollouts are sampled once (the recipe's own ``rollout``) from a tiny GPT, the policy is then moved a little
(so ratios leave 1 and the clip, the KL term and the global batch std all matter), and each layout runs the
recipe's ``loss`` on its share of the micro-batches, backward with the loop's ``1/grad_accum`` and the
data-parallel mean of gradients (what DDP/FSDP2 do)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import shared_ranks
import torch
import torch.nn.functional as F

from crosstrain.config import load_config
from crosstrain.plugins.rlhf.rl.grpo import GRPORecipe
from crosstrain.recipes.lm import build_model

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
SETS = ["model.n_layers=1", "model.dim=32", "model.n_heads=2", "train.batch_size=16", "rl.num_generations=2",
        "rl.max_new_tokens=6", "rl.beta=0.05", "rl.scale_rewards=batch", "rl.epsilon=0.05", "rl.dual_clip=2.0",
        "rl.entropy_coef=0.01", "train.recipe=grpo"]


def _recipe(prompts: str, mode: str, grad_accum: int, dp_rank: int, dp: int) -> GRPORecipe:
    cfg = load_config(None, [*SETS, f"data.path={prompts}", f"rl.aggregation={mode}", f"train.grad_accum={grad_accum}"])
    recipe = GRPORecipe()
    recipe.validate(cfg)
    recipe.configure(cfg, dp_rank, dp, dp)
    return recipe


def _merge(chunks: list[dict]) -> dict:
    """Micro-batches as one: ``ids`` right-padded to the widest (the padding is never attended to)."""
    width = max(c["ids"].shape[1] for c in chunks)
    out = {k: torch.cat([c[k] for c in chunks]) for k in chunks[0] if k != "ids"}
    out["ids"] = torch.cat([F.pad(c["ids"], (0, width - c["ids"].shape[1])) for c in chunks])
    return out


def _layout(collective, path: str, dp: int, grad_accum: int) -> dict:
    """Loss and gradients of one layout on this rank (``collective`` is None for one process)."""
    data = torch.load(path, weights_only=True)
    rank = collective.rank if collective is not None else 0
    mine = list(zip(data["chunks"], data["sums"], strict=True))[rank * 4 // dp:(rank + 1) * 4 // dp]
    per = len(mine) // grad_accum
    micro = [mine[i * per:(i + 1) * per] for i in range(grad_accum)]
    micro = [(_merge([c for c, _ in m]), torch.stack([s for _, s in m]).sum(0)) for m in micro]
    out = {}
    for mode in MODES:
        recipe = _recipe(str(Path(path).with_name("prompts.jsonl")), mode, grad_accum, rank, dp)
        policy = build_model(recipe_config())
        policy.load_state_dict(data["moved"])
        losses, metrics = [], []
        for batch in recipe.tag([{**b, "rl_sums": s} for b, s in micro]):  # the step's one all-reduce
            res = recipe.loss({"policy": policy}, batch)
            (res.loss / grad_accum).backward()
            losses.append(res.loss.detach())
            metrics.append(torch.tensor([float(res.metrics[k]) for k in ("entropy", "clip_ratio/region_mean")]))
        grads = torch.cat([p.grad.reshape(-1) for p in policy.parameters()])
        loss, mets = torch.stack(losses).mean(), torch.stack(metrics).mean(0)
        if collective is not None:  # the loop's mean over data-parallel ranks (and DDP's mean of gradients)
            import torch.distributed as dist

            for t in (grads, loss, mets):
                dist.all_reduce(t)
                t /= dp
        out[mode] = {"loss": float(loss), "grads": grads.numpy(), "metrics": mets.numpy()}  # numpy: by value
    return out


def _two_layouts(collective, path: str) -> tuple[dict, dict]:
    return _layout(collective, path, 2, 1), _layout(collective, path, 2, 2)


def recipe_config():
    return load_config(None, SETS)


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rl")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"prompt {i}: say a"}) + "\n" for i in range(20)))
    torch.manual_seed(0)
    recipe = _recipe(str(root / "prompts.jsonl"), "token-mean", 4, 0, 1)
    policy = build_model(recipe_config())
    recipe.context = SimpleNamespace(models={"policy": policy, "reference": copy.deepcopy(policy)},
                                     device=torch.device("cpu"))
    seed = recipe.rng.next_seed()
    chunks = [recipe.rollout(list(range(4 * i, 4 * i + 4)), seed) for i in range(4)]  # 4 x (2 prompts x 2 completions)
    sums = [c.pop("rl_sums") for c in chunks]
    g = torch.Generator().manual_seed(1)
    for chunk, s in zip(chunks, sums, strict=True):  # ragged lengths, as stop tokens would make them
        ends = torch.randint(1, chunk["mask"].shape[1] + 1, (chunk["mask"].shape[0], 1), generator=g)
        chunk["mask"] &= torch.arange(chunk["mask"].shape[1]) < ends
        s[0] = chunk["mask"].sum()  # SUMS[0] = tokens
    with torch.no_grad():  # the policy moves after sampling: ratios != 1, clipping active
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch.save({"chunks": chunks, "sums": sums, "moved": policy.state_dict()}, root / "rollouts.pt")
    return root / "rollouts.pt"


def test_loss_and_grads_match_across_ranks_and_grad_accum(rollouts) -> None:
    base = _layout(None, str(rollouts), 1, 1)
    accum = _layout(None, str(rollouts), 1, 4)
    two, two_accum = shared_ranks.run(_two_layouts, str(rollouts))[0]
    assert float(base["token-mean"]["metrics"][1]) > 0  # some tokens were clipped: the test is not at ratio 1
    losses = {m: base[m]["loss"] for m in MODES}
    assert len({round(v, 6) for v in losses.values()}) == len(MODES)  # the modes differ from each other
    for name, other in (("grad_accum 4", accum), ("2 ranks", two), ("2 ranks x grad_accum 2", two_accum)):
        for mode in MODES:
            ref = base[mode]
            assert other[mode]["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6), (name, mode)
            for key in ("grads", "metrics"):
                torch.testing.assert_close(torch.from_numpy(other[mode][key]), torch.from_numpy(ref[key]),
                                           rtol=1e-5, atol=1e-6, msg=f"{name} {mode} {key}")


OPTIONS = [("rl.advantage=rloo",), ("rl.importance_sampling_level=sequence", "rl.epsilon_high=0.3"),
           ("rl.scale_rewards=none", "rl.kl_estimator=k1", "rl.kl_clamp=0.01"),
           ("rl.scale_rewards=group", "rl.kl_estimator=k2", "rl.dual_clip=0", "rl.entropy_coef=0")]


def test_every_option_reaches_the_loss(rollouts) -> None:
    """The recipe's loss equals the pure functions composed by hand, for options the layout test leaves at one
    value (one process, one micro-batch: the global batch is the batch)."""
    from crosstrain.plugins.rlhf.rl.advantages import group_advantages, rloo_advantages
    from crosstrain.plugins.rlhf.rl.aggregate import aggregate
    from crosstrain.plugins.rlhf.rl.kl import kl_estimate
    from crosstrain.plugins.rlhf.rl.policy_loss import clipped_surrogate, log_ratio
    from crosstrain.plugins.rlhf.rl.rollout import completion_logits

    data = torch.load(rollouts, weights_only=True)
    batch, sums = _merge(data["chunks"]), torch.stack(data["sums"]).sum(0)
    prompts = str(rollouts.with_name("prompts.jsonl"))
    seen = set()
    for sets in OPTIONS:
        cfg = load_config(None, [*SETS, f"data.path={prompts}", *sets])
        recipe = GRPORecipe()
        recipe.validate(cfg)
        recipe.configure(cfg, 0, 1, 1)
        sec = recipe.sec
        policy = build_model(recipe_config())
        policy.load_state_dict(data["moved"])
        got = recipe.loss({"policy": policy}, recipe.tag([{**batch, "rl_sums": sums}])[0]).loss
        mask, rewards = batch["mask"], batch["rl_rewards"]
        logp_all = completion_logits(policy, batch["ids"], batch["index"]).float().log_softmax(-1)
        logps = logp_all.gather(-1, batch["tokens"].unsqueeze(-1)).squeeze(-1)
        adv = (rloo_advantages(rewards, 2) if sec.advantage == "rloo"
               else group_advantages(rewards, 2, sec.scale_rewards, batch_std=rewards.std()))
        ratio = log_ratio(logps, batch["rollout_logps"], mask, sec.importance_sampling_level)
        per = clipped_surrogate(ratio, adv.unsqueeze(1), sec.epsilon, sec.epsilon_high, sec.dual_clip).loss
        per = per + sec.beta * kl_estimate(logps, batch["ref_logps"], sec.kl_estimator, sec.kl_clamp)
        per = per + sec.entropy_coef * (logp_all.exp() * logp_all).sum(-1)
        want = aggregate(per, mask, sec.aggregation, tokens=float(mask.sum()), sequences=len(rewards))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=str(sets))
        seen.add(round(float(got.detach()), 6))
    assert len(seen) == len(OPTIONS)  # each option changed the loss
    # reward.fn: called with the decoded completions (and their prompts) by the recipe's scoring
    from crosstrain.plugins.rlhf.rl.rollout import Packed, completion_texts

    cfg = load_config(None, [*SETS, f"data.path={prompts}", "reward.fn=test_rlhf_rl_recipes:length_and_prompt"])
    recipe = GRPORecipe()
    recipe.validate(cfg)
    recipe.configure(cfg, 0, 1, 1)
    none = torch.zeros(len(batch["scores"]), dtype=torch.bool)
    packed = Packed(ids=batch["ids"], index=batch["index"], tokens=batch["tokens"], mask=batch["mask"],
                    logprobs=batch["rollout_logps"], ends=none.long(), stopped=none)
    texts = completion_texts(batch["tokens"], batch["mask"], none, recipe.tokenizer)
    prompt_texts = [recipe.prompt_text["train"][i // 2] for i in range(len(texts))]
    want = torch.tensor([len(t) + 0.01 * len(p) for t, p in zip(texts, prompt_texts, strict=True)])
    recipe.context = SimpleNamespace(step=0)  # score names the step in a reward.fn error
    torch.testing.assert_close(recipe.score(packed, list(range(len(texts) // 2)), "train", 2), want)
    # kl_in = reward: grpo lowers each completion's reward by beta * its summed KL before the group advantage
    cfg = load_config(None, [*SETS, f"data.path={prompts}", "rl.kl_in=reward"])
    recipe = GRPORecipe()
    recipe.validate(cfg)
    recipe.configure(cfg, 0, 1, 1)
    kl = torch.rand(batch["mask"].shape) * batch["mask"]
    out = recipe.prepare({}, None, batch["scores"], kl, {})  # type: ignore[arg-type]
    torch.testing.assert_close(out["rl_rewards"], batch["scores"] - 0.05 * kl.sum(1))


def test_ppo_options_reach_its_advantages_and_value_loss(rollouts) -> None:
    """ppo's GAE (gamma, lam), KL reward penalty, whitening and clipped value loss (vf_coef, cliprange_value)
    equal the pure functions composed by hand."""
    from crosstrain.plugins.rlhf.rl.advantages import gae, whiten
    from crosstrain.plugins.rlhf.rl.aggregate import aggregate
    from crosstrain.plugins.rlhf.rl.policy_loss import clipped_value_loss
    from crosstrain.plugins.rlhf.rl.ppo import PPORecipe
    from crosstrain.plugins.rlhf.rl.recipe import scalar_head_gpt
    from crosstrain.plugins.rlhf.rl.rollout import Packed, completion_logits

    data = torch.load(rollouts, weights_only=True)
    batch = _merge(data["chunks"])
    sets = [*SETS, f"data.path={rollouts.with_name('prompts.jsonl')}", "train.recipe=ppo", "rl.gamma=0.9",
            "rl.lam=0.7", "rl.kl_in=reward", "rl.vf_coef=0.5", "rl.cliprange_value=0.01"]
    cfg = load_config(None, sets)
    recipe = PPORecipe()
    recipe.validate(cfg)
    recipe.configure(cfg, 0, 1, 1)
    torch.manual_seed(3)
    value = scalar_head_gpt(cfg)
    mask, scores = batch["mask"], batch["scores"]
    packed = Packed(ids=batch["ids"], index=batch["index"], tokens=batch["tokens"], mask=mask,
                    logprobs=batch["rollout_logps"], ends=torch.zeros(0), stopped=torch.zeros(0))
    kl = torch.rand(mask.shape) * mask
    sums: dict = {}
    with torch.no_grad():  # as in rollout()
        out = recipe.prepare({"value": value}, packed, scores, kl, sums)
        v = completion_logits(value, batch["ids"], batch["index"])[..., 0] * mask
    rewards = -0.05 * kl
    last = mask.sum(1) - 1
    rewards[torch.arange(len(scores)), last] += scores
    adv, ret = gae(rewards, v, mask, 0.9, 0.7)
    torch.testing.assert_close(out["gae_advantages"], adv)
    torch.testing.assert_close(out["returns"], ret)
    n = float(mask.sum())
    mean = float(adv.sum()) / n
    var = (float((adv.double() ** 2).sum()) - n * mean * mean) / (n - 1)
    g = {"tokens": n, "sequences": len(scores), "adv": float(sums["adv"]), "adv_sq": float(sums["adv_sq"])}
    full = {**batch, **out}
    torch.testing.assert_close(recipe.advantages(full, g), whiten(adv, mask, mean, var))
    recipe.sec.whiten_advantages = False
    torch.testing.assert_close(recipe.advantages(full, g), adv)
    with torch.no_grad():
        value.output.weight.add_(0.1)  # the value model moved since the rollout: the clip matters
    loss, metrics = recipe.extra_loss({"value": value}, full, g, 1)
    moved = completion_logits(value, batch["ids"], batch["index"])[..., 0].float()
    vloss, hit = clipped_value_loss(moved, out["old_values"], ret, 0.01)
    torch.testing.assert_close(loss, 0.5 * aggregate(vloss, mask, "token-mean", tokens=n, sequences=1))
    assert 0 < float(metrics["val/clipfrac"]) <= 1


def test_prepare_step_tags_the_step_and_the_kl_coefficient_moves_after_the_optimizer_step(rollouts) -> None:
    """``prepare_step`` samples every micro-batch of the step and tags each with the step's summed statistics and
    its position; the adaptive KL coefficient stays put through the losses and moves once, in
    ``after_optimizer_step``, by the step's per-sequence KL (Ziegler et al. 2019)."""
    from crosstrain.plugins.rlhf.rl.kl import AdaptiveKLController
    from crosstrain.plugins.rlhf.rl.recipe import PromptDataset

    prompts = str(rollouts.with_name("prompts.jsonl"))
    cfg = load_config(None, [*SETS, f"data.path={prompts}", "rl.kl_target=0.01", "rl.kl_horizon=50",
                             "train.grad_accum=2"])
    recipe = GRPORecipe()
    recipe.validate(cfg)
    recipe.configure(cfg, 0, 1, 1)
    torch.manual_seed(0)
    policy = build_model(recipe_config())
    reference = copy.deepcopy(policy)
    with torch.no_grad():  # the reference differs from the policy: the KL is not 0
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    recipe.context = SimpleNamespace(models={"policy": policy, "reference": reference}, step=0)
    data = PromptDataset(len(recipe.prompts["train"]))
    step = recipe.prepare_step([data.batch([0, 1, 2, 3]), data.batch([4, 5, 6, 7])], recipe.context)
    assert [b["rl_micro"] for b in step] == [0, 1] and step[0]["rl_stats"] is step[1]["rl_stats"]
    g = step[0]["rl_stats"]
    # each micro-batch of 4 samples holds 2 prompts x 2 completions (rl.num_generations)
    assert g["sequences"] == 8 and g["tokens"] == sum(float(b["mask"].sum()) for b in step) and g["kl"] > 0
    beta = recipe.kl_ctl.beta
    for batch in step:
        recipe.loss({"policy": policy}, batch)
    assert recipe.kl_ctl.beta == beta
    recipe.after_optimizer_step(recipe.context, 1)
    want = AdaptiveKLController(0.05, 0.01, 50)
    want.update(g["kl"] / 8, 8)
    assert recipe.kl_ctl.beta == pytest.approx(want.beta) and recipe.kl_ctl.beta != beta
    recipe.after_optimizer_step(recipe.context, 2)  # no step prepared since: nothing to update
    assert recipe.kl_ctl.beta == pytest.approx(want.beta)
