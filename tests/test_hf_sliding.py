"""Sliding-window families against transformers: Mistral with ``sliding_window``, Qwen2 with ``use_sliding_window``
(+ ``max_window_layers``), Gemma 2 and Gemma 3 text (alternating local/global layers, soft-capping, sandwich norms,
``query_pre_attn_scalar``, q/k norms, local rope base, an explicit ``head_dim``).

Each model is built here with transformers' own config class, tiny, random weights with norms and biases moved
off their init values, saved sharded; every sequence is longer than the 8-token window. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import shared_ranks
import torch

transformers = pytest.importorskip("transformers")

from crosstrain.cli.main import main  # noqa: E402
from crosstrain.kernels import registry  # noqa: E402
from crosstrain.models.hf import iter_tensors, load_pretrained  # noqa: E402

WINDOW = 8
SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    # layer 0 global, layer 1 windowed (transformers: layers from max_window_layers on)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": WINDOW,
                                                  "max_window_layers": 1}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": WINDOW, "head_dim": 32,
                                                     "query_pre_attn_scalar": 24}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "sliding_window": WINDOW, "head_dim": 32, "query_pre_attn_scalar": 24,  # global layers: Gemma 3 4B's rope
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}}),
}
# what each family's GPTConfig must say (the mapping, not just the logits)
EXPECTED = {
    "mistral": {"sliding_window": WINDOW, "layer_windows": ()},
    "qwen2": {"layer_windows": (0, WINDOW), "qkv_bias": True},
    "gemma2": {"layer_windows": (WINDOW, 0), "attn_softcap": 50.0, "final_softcap": 30.0, "attn_head_dim": 32,
               "sandwich_norm": True, "tie_embeddings": True},
    "gemma3_text": {"layer_windows": (WINDOW, 0), "attn_softcap": 0.0, "qk_norm": "head",
                    "local_rope_theta": 10_000.0, "rope_theta": 1_000_000.0,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
}


def _hf(kind: str, folder: Path | None = None) -> torch.nn.Module:
    """The transformers model (eager attention: the reference that implements soft-capping)."""
    if folder is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    cfg_name, model_name, extra = FAMILIES[kind]
    cfg = getattr(transformers, cfg_name)(**SHAPE, **extra)
    cfg._attn_implementation = "eager"
    torch.manual_seed(11)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.3 if "norm" in name else 0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_sliding")
    dirs = {}
    for kind in FAMILIES:
        dirs[kind] = root / kind
        _hf(kind).save_pretrained(dirs[kind], safe_serialization=True, max_shard_size="60KB")
        assert (dirs[kind] / "model.safetensors.index.json").is_file()  # sharded
    return dirs


def _ids(t: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (batch, t), generator=torch.Generator().manual_seed(seed))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), registry.use_reference():
        out = model(ids)
    return getattr(out, "logits", out)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_logits_and_greedy_tokens_match_transformers(hf_dirs: dict[str, Path], kind: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    ref, ours = _hf(kind, hf_dirs[kind]), load_pretrained(hf_dirs[kind]).eval()
    for field, value in EXPECTED[kind].items():
        assert getattr(ours.config, field) == value, field
    ids = _ids(3 * WINDOW + 5)
    torch.testing.assert_close(_logits(ours, ids), _logits(ref, ids), atol=1e-5, rtol=0)
    # greedy decoding through the KV cache: prompt + 32 new tokens run far past the window
    prompt = _ids(6, batch=1, seed=1)
    ref.generation_config.eos_token_id = None  # crosstrain generate without a tokenizer knows no EOS: 32 tokens
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(prompt))
    capsys.readouterr()
    assert main(["generate", str(hf_dirs[kind]), "--prompt-ids", ",".join(map(str, prompt[0].tolist())),
                 "--max-new-tokens", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_ids"] == want[0, 6:].tolist()


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_round_trip_hf_crosstrain_hf_is_bit_exact(hf_dirs: dict[str, Path], tmp_path: Path, kind: str) -> None:
    out = tmp_path / "out"
    assert main(["export", str(hf_dirs[kind]), "--format", "hf", "--out", str(out), "--max-shard-size", "60KB"]) == 0
    before, after = dict(iter_tensors(hf_dirs[kind])), dict(iter_tensors(out))
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    src, dst = (json.loads((d / "config.json").read_text()) for d in (hf_dirs[kind], out))
    for field in ("model_type", "sliding_window", "layer_types", "use_sliding_window", "query_pre_attn_scalar",
                  "attn_logit_softcapping", "final_logit_softcapping", "head_dim", "rope_parameters"):
        if field in src:
            assert dst.get(field) == src[field], field
    ids = _ids(20)
    assert torch.equal(_logits(_hf(kind, out), ids), _logits(_hf(kind, hf_dirs[kind]), ids))


# -- one process vs two: forward logits (plain and packed documents) and one training step -------------------------
LAYOUTS = {"dp_shard": {"dp_shard": 2}, "tp": {"dp_shard": 1, "tp": 2}}
BATCH, SEQ = 4, 3 * WINDOW
DOCS = torch.tensor([0] * 5 + [1] * 13 + [2] * 6)  # a document longer than the window between two short ones


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One-process reference: logits, packed logits, loss and gradient norm."""
    from crosstrain import kernels

    logits = model(x)
    loss = kernels.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    with torch.no_grad():
        packed = model(x, doc_ids=DOCS.expand(x.shape[0], -1))
    return {"logits": logits.detach().numpy(), "packed": packed.numpy(), "loss": loss.item(), "norm": norm.item()}


def _ranks(collective: Any, dirs: dict[str, str]) -> dict[str, dict[str, Any]]:
    from crosstrain.parallel import ParallelDims, build_mesh, dp_rank_and_size, parallelize

    x, y = _ids(SEQ, BATCH, seed=5), _ids(SEQ, BATCH, seed=6)
    out = {}
    for kind, folder in dirs.items():
        for name, dims_kw in LAYOUTS.items():
            dims = ParallelDims(world_size=collective.world_size, **dims_kw).resolve()
            mesh = build_mesh(collective, dims)
            pm = parallelize(load_pretrained(folder), dims, mesh, torch.device("cpu"), precision="fp32")
            rank, size = dp_rank_and_size(mesh, dims)
            per = BATCH // size
            with torch.no_grad():
                logits = pm.module(x)
                packed = pm.module(x, doc_ids=DOCS.expand(BATCH, -1))
            loss, _ = pm.forward_backward(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
            out[f"{kind}/{name}"] = {"logits": logits.numpy(), "packed": packed.numpy(), "loss": loss.item(),
                                     "norm": pm.clip_grad_norm_(1e9).item()}
    return out


def test_two_ranks_dp_shard_and_tp_equal_one_process(hf_dirs: dict[str, Path]) -> None:
    results = shared_ranks.run(_ranks, {k: str(v) for k, v in hf_dirs.items()}, timeout=500)
    x, y = _ids(SEQ, BATCH, seed=5), _ids(SEQ, BATCH, seed=6)
    for kind, folder in hf_dirs.items():
        want = _step(load_pretrained(folder), x, y)
        for name in LAYOUTS:
            for rank_result in results:
                got = rank_result[f"{kind}/{name}"]
                for key in ("logits", "packed"):
                    torch.testing.assert_close(torch.from_numpy(got[key]), torch.from_numpy(want[key]), atol=1e-5,
                                               rtol=0, msg=lambda m, k=f"{kind}/{name}/{key}": f"{k}: {m}")
                for key in ("loss", "norm"):
                    assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), (kind, name, key, got[key], want[key])


@pytest.mark.parametrize(("kind", "changes", "field"), [
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0},
                                         "sliding_attention": {"rope_type": "default"}}},
     "rope_parameters.full_attention.rope_type"),
])
def test_gemma_options_it_does_not_compute_are_one_line_refusals(
    hf_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str,
    changes: dict[str, Any], field: str,
) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    cfg = json.loads((hf_dirs[kind] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **changes}))
    capsys.readouterr()
    assert main(["train", "--set", f"model.init_from={folder}"]) == 2
    err = capsys.readouterr().err.strip()
    assert field in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("kind", ["qwen2", "gemma2"])
def test_onnx_export_keeps_the_windows(hf_dirs: dict[str, Path], tmp_path: Path, kind: str) -> None:
    """A windowed family exported to ONNX passes export's parity gate (prefill 8 tokens, then decode past the
    8-token window through the cache), and onnxruntime's logits of a 24-token prefill equal transformers'."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import numpy as np

    from crosstrain.plugins.export.runtime import make_session, run

    out = tmp_path / f"{kind}.onnx"
    assert main(["export", str(hf_dirs[kind]), "--format", "onnx", "--out", str(out), "--json"]) == 0
    ids = _ids(24)
    session = make_session(out)
    names = [i.name for i in session.get_inputs()]
    cfg = json.loads((hf_dirs[kind] / "config.json").read_text())
    kv, dim = cfg["num_key_value_heads"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    empty = np.zeros((ids.shape[0], kv, 0, dim), dtype=np.float32)
    feeds = {names[0]: ids.numpy(), **{name: empty for name in names[1:]}}
    ours = torch.from_numpy(run(session, feeds)[0])
    torch.testing.assert_close(ours, _logits(_hf(kind, hf_dirs[kind]), ids), rtol=1e-4, atol=1e-4)
