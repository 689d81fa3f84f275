"""crosstrain's losses under TRL's names compute what TRL 1.16 computes (issue 38), each against TRL's formula
re-derived here from trl/trainer/{sft,dpo}_trainer.py (and against TRL itself where it is installed):

- SFT ``rlhf.loss_normalization="token"``: sum of completion-token NLLs / completion tokens of the whole
  grad-accumulation window (transformers' ``num_items_in_batch``), 30 steps of completions of 4-20 tokens;
- DPO ``sigmoid`` ignores label smoothing in TRL, so crosstrain refuses it there; ``cdpo`` and ``robust`` are the
  named smoothed variants; IPO's logged rewards are ``beta x`` the summed log-ratio, as TRL logs them;
- ``distill.temperature`` is refused (it meant the loss softening; TRL's GKDConfig.temperature is the sampling
  temperature): ``distill.loss_temperature`` / ``distill.sample_temperature``.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from in_process import crosstrain_main

from crosstrain.config import load_config
from crosstrain.data.tokenizer import ByteTokenizer
from crosstrain.models.gpt import GPT, GPTConfig
from crosstrain.plugins.rlhf import data as rdata
from crosstrain.plugins.rlhf.recipes import SFTRecipe


def _rows(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    words = "abcdefghij"
    return [(f"q{i % 10}: ", "".join(rng.choice(words) for _ in range(rng.randint(4, 20)))) for i in range(n)]


def trl_sft_loss(model: torch.nn.Module, window: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """TRL 1.16 ``SFTTrainer.compute_loss`` summed over one optimizer step's micro-batches: each is
    ``per_token_loss.sum() / num_items_in_batch`` with ``num_items_in_batch`` = labels != -100 over the window
    (transformers ``Trainer.get_batch_samples``), so the step's loss is the window's token mean."""
    labels = [torch.where(b["loss_mask"].bool(), b["input_ids"], -100)[:, 1:] for b in window]
    num_items = sum(int(lab.ne(-100).sum()) for lab in labels)
    total = torch.zeros(())
    for b, lab in zip(window, labels, strict=True):
        logits = model(b["input_ids"][:, :-1]).float()
        total = total + F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum")
    return total / num_items


def _sft_recipe(normalization: str) -> tuple[SFTRecipe, SimpleNamespace]:
    config = load_config(None, [f"rlhf.loss_normalization={normalization}"])
    recipe = SFTRecipe()
    recipe.sec = config.section("rlhf")
    return recipe, SimpleNamespace(config=config, mesh=None, dims=None)


def _train_30(normalization: str) -> tuple[list[float], list[float]]:
    """30 AdamW steps of 3 micro-batches x 4 rows: crosstrain's recipe (prepare_step, then the loop's mean of the
    micro-batch losses) beside a copy trained on :func:`trl_sft_loss`; both per-step losses."""
    dataset = rdata.encode_sft(ByteTokenizer(), _rows(48), 32, 8)
    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=256, dim=32, n_layers=2, n_heads=2, max_seq_len=64))
    ref = copy.deepcopy(ours)
    opt_ours, opt_ref = (torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (ours, ref))
    recipe, context = _sft_recipe(normalization)
    order = torch.randperm(48, generator=torch.Generator().manual_seed(1)).tolist()
    got, want = [], []
    for step in range(30):
        idx = [order[(step * 12 + k) % 48] for k in range(12)]
        window = [dataset.batch(idx[i : i + 4]) for i in range(0, 12, 4)]
        micro = recipe.prepare_step([dict(b) for b in window], context)
        losses = [recipe.loss({"policy": ours}, b).loss for b in micro]
        loss = sum(losses) / len(losses)  # the loop: the mean over micro-batches (core/engine/loop.py)
        opt_ours.zero_grad()
        loss.backward()
        opt_ours.step()
        theirs = trl_sft_loss(ref, window)
        opt_ref.zero_grad()
        theirs.backward()
        opt_ref.step()
        got.append(float(loss.detach()))
        want.append(float(theirs.detach()))
    return got, want


def test_sft_token_normalization_equals_trl_over_30_steps() -> None:
    lengths = [len(c) for _, c in _rows(48)]
    assert min(lengths) == 4 and max(lengths) == 20
    got, want = _train_30("token")
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    assert worst < 1e-5, worst
    seq, _ = _train_30("sequence")  # the per-sequence mean is measurably another loss (what the issue found)
    assert abs(seq[0] - want[0]) / want[0] > 1e-4


def _sft_run(tmp_path: Path, normalization: str, *extra: str, steps: int = 1, nproc: int = 1,
             name: str = "") -> list[float]:
    """The per-step losses of ``crosstrain train --recipe sft`` on 12 rows (batch = the whole set)."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in _rows(12)))
    run = tmp_path / (name or normalization)
    sets = ["model.n_layers=1", "model.dim=32", "model.n_heads=2", f"train.steps={steps}", "train.batch_size=12",
            "train.grad_accum=3", "train.seq_len=32", "rlhf.max_length=32", "rlhf.max_prompt_length=8",
            f"data.path={data}", f"data.val_path={data}", "eval.steps=0", "logging.progress=none", "backend=cpu",
            "optim.lr=1e-2", f"rlhf.loss_normalization={normalization}", *extra]
    args = ["train", "--recipe", "sft", "--run-dir", str(run)] + [a for s in sets for a in ("--set", s)]
    if nproc > 1:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        proc = subprocess.run([sys.executable, "-m", "crosstrain", *args, "--nproc", str(nproc)], capture_output=True,
                              text=True, env=dict(env, OMP_NUM_THREADS="1"), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert crosstrain_main(args) == 0
    return [float(json.loads(x)["loss"]) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def test_sft_token_normalization_is_what_crosstrain_train_runs(tmp_path) -> None:
    """Step 1 of a real ``crosstrain train --recipe sft`` (12 rows = the whole set, 3 micro-batches of uneven
    token counts): its logged loss is TRL's window token mean on the initial weights, whatever the row order."""
    from crosstrain.recipes.lm import build_model

    config = load_config(None, ["model.n_layers=1", "model.dim=32", "model.n_heads=2", "train.seq_len=32"])
    torch.manual_seed(config.train.seed)
    model = build_model(config)
    dataset = rdata.encode_sft(ByteTokenizer(), _rows(12), 32, 8)
    want = float(trl_sft_loss(model, [dataset.batch(list(range(12)))]))
    token = _sft_run(tmp_path, "token")[0]
    assert abs(token - want) / want < 1e-5, (token, want)
    assert abs(_sft_run(tmp_path, "sequence")[0] - want) / want > 1e-4


def test_sft_token_normalization_counts_tokens_over_ranks(tmp_path) -> None:
    """2 FSDP2 ranks (gloo, 6 rows each, 3 micro-batches of 2) train what 1 process does: the completion-token count
    is all-reduced over the ranks, as transformers' average_tokens_across_devices (losses within 1e-5, 3 steps)."""
    one = _sft_run(tmp_path, "token", steps=3, name="one")
    two = _sft_run(tmp_path, "token", "parallel.dp_shard=2", steps=3, nproc=2, name="two")
    assert len(one) == len(two) == 3
    assert max(abs(a - b) / b for a, b in zip(one, two, strict=True)) < 1e-5, (one, two)


# -- DPO: TRL 1.16 DPOTrainer (reverse-KL scores), re-derived ---------------------------------------------------------
def trl_dpo(pc, pr, rc, rr, cl, rl, beta, loss_type, label_smoothing):
    """trl/trainer/dpo_trainer.py 1.16 ``_compute_loss`` for ``f_divergence_type="reverse_kl"``, and its logged
    ``rewards/chosen``/``rewards/rejected`` (``beta * chosen_logratios``)."""
    chosen, rejected = pc - rc, pr - rr
    delta = chosen - rejected
    if loss_type == "sigmoid":
        loss = -F.logsigmoid(beta * delta)
    elif loss_type == "ipo":
        loss = (chosen / cl.clamp(min=1.0) - rejected / rl.clamp(min=1.0) - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        loss = (clean - flipped) / (1 - 2 * label_smoothing)
    return loss, beta * chosen, beta * rejected


def _pairs():
    g = torch.Generator().manual_seed(0)
    logps = [-torch.rand(16, generator=g, dtype=torch.float64) * 30 for _ in range(4)]
    lengths = [torch.randint(4, 21, (16,), generator=g).double() for _ in range(2)]
    return logps, lengths


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.1), ("ipo", 0.0), ("robust", 0.2)])
def test_dpo_losses_and_rewards_equal_trl(loss_type: str, eps: float) -> None:
    from crosstrain.plugins.rlhf.losses import dpo_loss

    (pc, pr, rc, rr), (cl, rl) = _pairs()
    ours = dpo_loss(pc, pr, rc, rr, cl, rl, beta=0.3, loss_type=loss_type,
                    label_smoothing=0.0 if loss_type == "sigmoid" else eps)
    theirs = trl_dpo(pc, pr, rc, rr, cl, rl, 0.3, loss_type, eps)  # TRL's sigmoid given eps=0.1 ignores it
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_cdpo_closed_form_and_sigmoid_refuses_label_smoothing(tmp_path, capsys) -> None:
    """cDPO (Mitchell 2023): ``-(1-eps) log s(beta h) - eps log s(-beta h)``, with h = 2, beta = 0.1, eps = 0.1;
    TRL's sigmoid would ignore eps (4e-3 apart here), so crosstrain refuses the pair with one line."""
    import math

    from crosstrain.plugins.rlhf.losses import dpo_loss

    logps = (torch.tensor([-4.0]), torch.tensor([-6.0]), torch.tensor([-5.0]), torch.tensor([-5.0]))
    s = 1 / (1 + math.exp(-0.2))
    loss, _, _ = dpo_loss(*logps, beta=0.1, loss_type="cdpo", label_smoothing=0.1)
    assert loss.item() == pytest.approx(-0.9 * math.log(s) - 0.1 * math.log(1 - s), rel=1e-6)
    assert abs(loss.item() + math.log(s)) > 1e-2  # not TRL's (smoothing-free) sigmoid
    with pytest.raises(ValueError, match="cdpo"):
        dpo_loss(*logps, beta=0.1, loss_type="sigmoid", label_smoothing=0.1)
    args = ["train", "--recipe", "dpo", "--run-dir", str(tmp_path / "r"), "--set", "rlhf.label_smoothing=0.1",
            "--set", "backend=cpu"]
    assert crosstrain_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "rlhf.loss_type=cdpo" in err[-1] and not (tmp_path / "r" / "metrics.jsonl").exists()


def test_ipo_rewards_are_beta_times_summed_log_ratios() -> None:
    """IPO's loss averages the log-ratios per token, but TRL logs ``beta x`` the summed ones: h_c = 1 over 2 tokens,
    h_r = -1 over 4, beta = 0.5 -> rewards 0.5 and -0.5 (the per-token form would log 0.25 and -0.125)."""
    from crosstrain.plugins.rlhf.losses import dpo_loss

    logps = (torch.tensor([-4.0]), torch.tensor([-6.0]), torch.tensor([-5.0]), torch.tensor([-5.0]))
    loss, chosen, rejected = dpo_loss(*logps, torch.tensor([2.0]), torch.tensor([4.0]), beta=0.5, loss_type="ipo")
    assert (chosen.item(), rejected.item()) == (0.5, -0.5)
    assert loss.item() == pytest.approx((0.5 + 0.25 - 1.0) ** 2)


# -- distillation temperatures ------------------------------------------------------------------------------------
def test_distill_temperature_is_refused_and_the_two_temperatures_are_wired(tmp_path, capsys) -> None:
    from crosstrain.plugins.compress.distill.losses import distill_loss

    args = ["train", "--recipe", "distill", "--run-dir", str(tmp_path / "r"), "--set", "distill.temperature=0.9",
            "--set", "backend=cpu"]
    assert crosstrain_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "distill.loss_temperature" in err and "distill.sample_temperature" in err
    config = load_config(None, ["distill.loss_temperature=2", "distill.sample_temperature=0.9"])
    sec = config.section("distill")
    assert (sec.loss_temperature, sec.sample_temperature) == (2.0, 0.9)
    assert load_config(None, []).section("distill").sample_temperature == 1.0  # GKDConfig's default is 0.9
    # loss_temperature is Hinton's T: forward KL of the T-softened distributions x T^2 (closed form on 1 token)
    s, t = torch.tensor([[[0.0, 1.0, 2.0]]]), torch.tensor([[[2.0, 0.0, 1.0]]])
    pt = (t / 2).log_softmax(-1)
    want = (pt.exp() * (pt - (s / 2).log_softmax(-1))).sum() * 4
    got = distill_loss(s, t, torch.ones(1, 1, dtype=torch.bool), loss="forward_kl", temperature=2.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_distill_divides_each_micro_batch_by_its_own_tokens_unlike_gkd_1_16() -> None:
    """A remaining difference (docs/compress.md): TRL 1.16's GKDTrainer divides the window's summed divergence by
    ``num_items_in_batch`` (all completion tokens of the grad-accumulation window); ``distill_loss`` is each
    micro-batch's own token mean, averaged by the loop. Equal when every micro-batch counts as many tokens."""
    from crosstrain.plugins.compress.distill.losses import distill_loss

    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 2, 6, 5, generator=g), torch.randn(2, 2, 6, 5, generator=g)
    masks = torch.zeros(2, 2, 6, dtype=torch.bool)
    masks[0, :, :1], masks[1, :, :6] = True, True  # 2 and 12 counted tokens
    ours = sum(distill_loss(s[i], t[i], masks[i]) for i in range(2)) / 2
    per_token = [(t[i].softmax(-1) * (t[i].log_softmax(-1) - s[i].log_softmax(-1))).sum(-1) for i in range(2)]
    sums, counts = [float((p * m).sum()) for p, m in zip(per_token, masks, strict=True)], [2, 12]
    gkd = sum(sums) / sum(counts)
    assert float(ours) == pytest.approx((sums[0] / 2 + sums[1] / 12) / 2, rel=1e-6)
    assert abs(float(ours) - gkd) / gkd > 1e-3  # 4.6e-3 relative here
    masks[0, :, :6] = True  # equal counts: the same loss
    even = sum(distill_loss(s[i], t[i], masks[i]) for i in range(2)) / 2
    full = sum(float((p * masks[i]).sum()) for i, p in enumerate(per_token)) / 24
    assert float(even) == pytest.approx(full, rel=1e-6)


def test_distill_alpha_mixes_the_label_nll_and_alpha_1_is_gkd() -> None:
    """``alpha`` x divergence + (1 - alpha) x label NLL per data micro-batch; GKD's loss is the divergence alone,
    which is ``alpha = 1`` and every sampled micro-batch (docs/compress.md's table)."""
    from crosstrain.plugins.compress.distill.data import DistillBatch
    from crosstrain.plugins.compress.distill.recipe import DistillRecipe

    torch.manual_seed(0)
    student, teacher = (GPT(GPTConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, max_seq_len=16))
                        for _ in range(2))
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    batch = DistillBatch(inputs=ids[:, :-1], targets=ids[:, 1:], mask=torch.ones(2, 8, dtype=torch.bool),
                         prompt_lengths=torch.zeros(2, dtype=torch.long), index=torch.arange(2))
    recipe = DistillRecipe()
    models = {"student": student, "teacher": teacher}
    losses = {}
    for alpha in (0.3, 1.0):
        recipe.sec = load_config(None, [f"distill.alpha={alpha}"]).section("distill")
        out = recipe.loss(models, batch)
        losses[alpha] = (float(out.loss), float(out.metrics["kd"]), float(out.metrics["nll/student"]))
    loss, kd, nll = losses[0.3]
    assert loss == pytest.approx(0.3 * kd + 0.7 * nll, rel=1e-6) and abs(nll - kd) > 1e-3
    assert losses[1.0][0] == pytest.approx(kd, rel=1e-6)  # GKD: the divergence alone
    batch.sampled = True  # a sampled micro-batch trains on the divergence alone whatever alpha
    recipe.sec = load_config(None, ["distill.alpha=0.3"]).section("distill")
    assert float(recipe.loss(models, batch).loss) == pytest.approx(kd, rel=1e-6)
