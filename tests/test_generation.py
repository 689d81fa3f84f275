"""The generation engine (crosstrain.generation): cached decoding equals recomputing the prefix, log-probs equal a
teacher-forced forward, ragged batches equal prompts alone, seeded sampling reproduces and respects top-k/top-p,
per-row noise samples a row the same in any batch, and an FSDP2-sharded model (2 gloo ranks) generates what the
unsharded one does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from crosstrain.errors import ConfigError
from crosstrain.generation import GenerationConfig, filter_logits, generate
from crosstrain.models.gpt import GPT, build_gpt
from crosstrain.testing.multiprocess import run_ranks

PROMPTS = [[7, 3, 99, 12, 5, 200, 31, 8, 77, 64, 2, 150], [42], [10, 20, 30, 40, 50], [255, 0, 128]]


def _model(**overrides: Any) -> GPT:
    torch.manual_seed(0)
    model = build_gpt("tiny", **overrides).eval()
    with torch.no_grad():  # sharper than the init's near-uniform logits, so argmax ties cannot blur the checks
        model.output.weight.mul_(4.0)  # type: ignore[union-attr]
    return model


def _uncached_greedy(model: GPT, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat((ids, model(ids)[:, -1].argmax(-1, keepdim=True)), dim=1)
    return ids[0, len(prompt):].tolist()


def _teacher_forced_logits(model: GPT, prompt: list[int], new: list[int]) -> torch.Tensor:
    """Logits ``[len(new), vocab]`` that GPT.forward gives for each new token, on the unpadded row."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + new]))[0]
    return logits[len(prompt) - 1: len(prompt) + len(new) - 1]


def test_greedy_cached_equals_uncached_logprobs_equal_teacher_forced_ragged_equals_alone() -> None:
    model = _model(n_kv_heads=2)  # grouped-query attention (the sampling test below runs multi-head)
    cfg = GenerationConfig(max_new_tokens=64, greedy=True, pad_token=1)
    batch = generate(model, PROMPTS, cfg)
    assert batch.tokens.shape == (4, 64) and batch.mask.all() and batch.lengths.tolist() == [64] * 4
    assert batch.sequences.shape == (4, 12 + 64) and batch.prompt_mask.sum(1).tolist() == [12, 1, 5, 3]
    for row, prompt in enumerate(PROMPTS):
        assert batch.sequences[row, 12 - len(prompt): 12].tolist() == prompt
        assert (batch.sequences[row, : 12 - len(prompt)] == 1).all()  # left padding
        new = batch.tokens[row].tolist()
        if row == 1:  # the most padded row (11 pads) against recomputing the whole prefix for every token
            assert new == _uncached_greedy(model, prompt, 64), "cached greedy differs from uncached"
        alone = generate(model, [prompt], GenerationConfig(max_new_tokens=24, greedy=True))  # greedy: a prefix
        assert alone.tokens[0].tolist() == new[:24], f"row {row}: the ragged batch differs from the prompt alone"
        torch.testing.assert_close(alone.logprobs[0], batch.logprobs[row, :24], rtol=0, atol=1e-5)
        ref = torch.log_softmax(_teacher_forced_logits(model, prompt, new).float(), -1)
        ref = ref.gather(-1, batch.tokens[row].unsqueeze(-1)).squeeze(-1)
        assert batch.logprobs.dtype == torch.float32
        torch.testing.assert_close(batch.logprobs[row], ref, rtol=0, atol=1e-5)
        assert len(set(new)) > 2  # a real continuation, not one repeated token


def test_sampling_seeded_top_k_top_p_and_stop_tokens() -> None:
    model = _model()
    cfg = GenerationConfig(max_new_tokens=16, temperature=1.3, top_k=5, top_p=0.9)
    out = generate(model, PROMPTS, cfg, torch.Generator().manual_seed(3))
    again = generate(model, PROMPTS, cfg, torch.Generator().manual_seed(3))
    other = generate(model, PROMPTS, cfg, torch.Generator().manual_seed(4))
    assert torch.equal(out.tokens, again.tokens) and torch.equal(out.logprobs, again.logprobs)
    assert not torch.equal(out.tokens, other.tokens)
    for row, prompt in enumerate(PROMPTS):  # every draw lies in the top-k ∩ nucleus of the model's own logits
        new = out.tokens[row].tolist()
        logits = _teacher_forced_logits(model, prompt, new)
        ref = torch.log_softmax(logits, -1).gather(-1, out.tokens[row].unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(out.logprobs[row], ref, rtol=0, atol=1e-5)  # untempered, unfiltered log-probs
        allowed = filter_logits(logits, 1.3, 5, 0.9).isfinite()
        assert allowed[torch.arange(len(new)), out.tokens[row]].all()
        assert (allowed.sum(-1) <= 5).all() and (allowed.sum(-1) < 5).any()  # top-p bites somewhere

    # closed form: probabilities [0.5, 0.3, 0.15, 0.05]; the nucleus of 0.8 is {0, 1}, of 0.81 is {0, 1, 2}
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert filter_logits(logits, top_p=0.8).isfinite().tolist() == [[True, True, False, False]]
    assert filter_logits(logits, top_p=0.81).isfinite().tolist() == [[True, True, True, False]]
    assert filter_logits(logits, top_k=1).isfinite().tolist() == [[True, False, False, False]]
    # the most likely token always stays, even for a top_p that is 0 in fp32 (issue 39: NaN, then multinomial raised)
    assert filter_logits(logits, top_p=1e-300).isfinite().tolist() == [[True, False, False, False]]
    torch.testing.assert_close(filter_logits(logits, temperature=2.0), logits / 2.0)
    # empirical frequencies of 20000 draws match the renormalised nucleus {0.5, 0.3, 0.15} / 0.95
    from crosstrain.generation import next_tokens

    draws = next_tokens(logits.expand(20000, 4), greedy=False, top_p=0.81, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, rtol=0, atol=0.015)
    # per-row noise: the same frequencies by inverse CDF; a row's completion depends on its own noise only
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    draws = next_tokens(logits.expand(20000, 4), greedy=False, top_p=0.81, uniform=u)
    freq = torch.bincount(draws, minlength=4).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, rtol=0, atol=0.015)
    noise = torch.rand((len(PROMPTS), 16), generator=torch.Generator().manual_seed(5))
    batch = generate(model, PROMPTS, cfg, noise=noise)
    for row in (1, 3):  # alone, and in another batch (other padding, other neighbours)
        alone = generate(model, [PROMPTS[row]], cfg, noise=noise[row: row + 1])
        pair = generate(model, [PROMPTS[2], PROMPTS[row]], cfg, noise=noise[[2, row]])
        assert alone.tokens[0].tolist() == pair.tokens[1].tolist() == batch.tokens[row].tolist()
    assert not torch.equal(batch.tokens, generate(model, PROMPTS, cfg, noise=noise.roll(1, 1)).tokens)
    with pytest.raises(ConfigError, match="one uniform per row"):
        generate(model, PROMPTS, cfg, noise=noise[:, :3])

    # stop tokens: row 0 stops at its first emitted stop token; the other rows run on, then pad
    greedy = generate(model, PROMPTS, GenerationConfig(max_new_tokens=12, greedy=True)).tokens
    stop = int(greedy[0, 5])
    first = greedy[0].tolist().index(stop)
    stopped = generate(model, PROMPTS, GenerationConfig(max_new_tokens=12, greedy=True, stop_tokens=(stop,),
                                                        pad_token=3))
    for row in range(4):
        hits = (greedy[row] == stop).nonzero()
        n = int(hits[0]) + 1 if len(hits) else 12
        assert int(stopped.lengths[row]) == n and stopped.mask[row].tolist() == [True] * n + [False] * (12 - n)
        assert stopped.tokens[row, :n].tolist() == greedy[row, :n].tolist()
        assert (stopped.tokens[row, n:] == 3).all() and (stopped.logprobs[row, n:] == 0).all()
    assert int(stopped.lengths[0]) == first + 1


def test_compiled_static_step_emits_the_eager_tokens_and_logprobs() -> None:
    """``compile=True``: one torch.compile-d static-shape step over the whole cache under a mask (ragged prompts,
    so the pad mask and the unwritten-slot mask both bite) gives eager decoding's greedy and seeded-sampled tokens,
    and log-probs within 1e-5 of eager's and of a teacher-forced forward."""
    model = _model(n_kv_heads=2)
    for kw in ({"greedy": True}, {"top_k": 8}):  # the same shapes: one compiled graph serves both
        eager = generate(model, PROMPTS, GenerationConfig(max_new_tokens=8, pad_token=1, **kw),
                         torch.Generator().manual_seed(2))
        compiled = generate(model, PROMPTS, GenerationConfig(max_new_tokens=8, pad_token=1, compile=True, **kw),
                            torch.Generator().manual_seed(2))
        assert torch.equal(compiled.tokens, eager.tokens) and torch.equal(compiled.sequences, eager.sequences), kw
        torch.testing.assert_close(compiled.logprobs, eager.logprobs, rtol=0, atol=1e-5)
        ref = torch.log_softmax(_teacher_forced_logits(model, PROMPTS[1], compiled.tokens[1].tolist()), -1)
        ref = ref.gather(-1, compiled.tokens[1].unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(compiled.logprobs[1], ref, rtol=0, atol=1e-5)  # the most padded row


def test_bad_inputs_are_one_line_config_errors() -> None:
    model = _model()
    with pytest.raises(ConfigError, match="at least one token"):
        generate(model, [[1], []], GenerationConfig())
    with pytest.raises(ConfigError, match="exceeds model.max_seq_len 256"):
        generate(model, [[1] * 250], GenerationConfig(max_new_tokens=10))
    with pytest.raises(ConfigError, match=r"\[0, 256\)"):
        generate(model, [[1, 300]], GenerationConfig())
    with pytest.raises(ConfigError, match="top_p"):
        GenerationConfig(top_p=0.0)
    with pytest.raises(ConfigError, match="greedy=True"):
        GenerationConfig(temperature=0.0)
    with pytest.raises(ConfigError, match="cache protocol"):
        generate(torch.nn.Linear(2, 2), [[1]], GenerationConfig())


def _sharded(collective: Any) -> dict[str, Any]:
    """Each rank: the unsharded reference, then the same model FSDP2-sharded over 2 ranks and TP-sharded over 2,
    on that rank's own prompts (FSDP ranks need not agree) or the shared ones (a TP group shares its batch)."""
    from torch.distributed.tensor import DTensor

    from crosstrain.parallel import ParallelDims, build_mesh, parallelize

    rank = collective.rank
    mine = [PROMPTS[rank], PROMPTS[rank + 2]]
    greedy = GenerationConfig(max_new_tokens=12, greedy=True)
    sampled = GenerationConfig(max_new_tokens=12, top_k=8)
    ref = _model()
    out: dict[str, Any] = {}
    for name, dims_kw, prompts in (("fsdp", {"dp_shard": 2}, mine), ("tp", {"dp_shard": 1, "tp": 2}, PROMPTS[:2])):
        want_g = generate(ref, prompts, greedy)
        want_s = generate(ref, prompts, sampled, torch.Generator().manual_seed(5))
        dims = ParallelDims(world_size=2, **dims_kw).resolve()
        pm = parallelize(_model(), dims, build_mesh(collective, dims), torch.device("cpu"), precision="fp32")
        got_g = generate(pm.module, prompts, greedy)
        got_s = generate(pm.module, prompts, sampled, torch.Generator().manual_seed(5))
        weight = pm.module.get_parameter("layers.0.attention.wq.weight")
        try:
            generate(pm.module, prompts, GenerationConfig(max_new_tokens=2, compile=True))
            compile_refused = False
        except ConfigError as e:
            compile_refused = "unsharded model" in str(e)
        out[name] = {
            "greedy": torch.equal(got_g.tokens, want_g.tokens), "sampled": torch.equal(got_s.tokens, want_s.tokens),
            "logprob_err": float((got_g.logprobs - want_g.logprobs).abs().max()),
            "resharded": isinstance(weight, DTensor) and weight.to_local().shape[0] == 32,
            "trains_after": bool(torch.isfinite(pm.module(torch.tensor([PROMPTS[0]]))).all()),
            "compile_refused": compile_refused,
        }
    return out


def test_fsdp2_and_tp_sharded_generate_what_the_unsharded_model_does() -> None:
    for rank, result in enumerate(run_ranks(_sharded, 2, timeout=240)):
        for name, r in result.items():
            assert r["greedy"] and r["sampled"], f"rank {rank} {name}: {r}"
            assert r["logprob_err"] <= 1e-5 and r["resharded"] and r["trains_after"], f"rank {rank} {name}: {r}"
            assert r["compile_refused"], f"rank {rank} {name}: compile=True accepted a sharded model"


def test_export_torch_engine_decodes_like_the_core_engine() -> None:
    """``crosstrain generate --engine torch``'s loop runs on the static cache and the shared sampling code."""
    from crosstrain.plugins.export.generate import Sampling, TorchEngine
    from crosstrain.plugins.export.generate import generate as export_generate

    model = _model()
    prompt = PROMPTS[0]
    assert export_generate(TorchEngine(model), prompt, 16)[0] == generate(
        model, [prompt], GenerationConfig(max_new_tokens=16, greedy=True)).tokens[0].tolist()
    sampled = export_generate(TorchEngine(model), prompt, 16, Sampling(temperature=1.0, seed=11))[0]
    assert sampled == export_generate(TorchEngine(model), prompt, 16, Sampling(temperature=1.0, seed=11))[0]
    assert sampled != export_generate(TorchEngine(model), prompt, 16)[0]


def test_a_temperature_below_the_floor_is_greedy_instead_of_overflowing() -> None:
    """Issue 39: ``temperature=2e-38`` made ``logits / temperature`` inf and torch.multinomial raise mid-decode."""
    from crosstrain.generation.sampling import MIN_TEMPERATURE, next_tokens

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 10
    for temperature in (2e-38, MIN_TEMPERATURE / 2):
        drawn = next_tokens(logits, greedy=False, temperature=temperature, generator=torch.Generator().manual_seed(1))
        assert torch.equal(drawn, logits.argmax(-1))
