"""Issue 39: ``logprobs`` and ``echo`` against an independent reference. The tiny run is exported to Hugging Face
format (``crosstrain export --format hf``) and loaded by transformers; its log-softmax over the prompt and the
served greedy tokens must match what a live ``crosstrain serve`` reports within 1e-4: completions' legacy shape
(with ``echo`` and ``max_tokens`` 0 or 1: lm-eval's loglikelihood request), and chat's ``content`` shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

OVERRIDES = ["train.seq_len=32", "train.batch_size=4", "model.n_layers=1", "logging.every=100"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from crosstrain.cli.main import main
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer
    from crosstrain.plugins.serve.config import ServeOptions
    from crosstrain.plugins.serve.server import Server

    root = tmp_path_factory.mktemp("serve_logprobs")
    Trainer(load_config(None, ["train.steps=2", *OVERRIDES]), run_dir=root / "run").fit()
    assert main(["export", str(root / "run"), "--format", "hf", "--out", str(root / "hf")]) == 0
    with Server(ServeOptions(str(root / "run"), port=0, max_batch=4, max_wait_ms=5, threads=1)) as server:
        yield {"url": server.url, "hf": root / "hf", "vocab": server.manager.current.vocab}


def _reference(folder: Any, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers on the exported model: the prompt and its ``n`` greedy tokens (argmax of a full forward each
    step), and the log-softmax ``[len(ids), vocab]`` over them (row i predicts token i + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids, torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_logprobs_and_echo_equal_transformers(served: dict[str, Any]) -> None:
    url, prompt = served["url"], [72, 101, 108, 108, 111, 44, 32, 119]
    reply = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3,
                                           "echo": True})["choices"][0]
    lp = reply["logprobs"]
    n = len(lp["tokens"]) - len(prompt)
    assert n == 6 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    generated = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                               "logprobs": 0})["choices"][0]
    assert reply["text"].endswith(generated["text"]) and len(generated["logprobs"]["tokens"]) == 6
    ids, ref = _reference(served["hf"], prompt, 6)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served["hf"])
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    expected = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), torch.tensor(expected), atol=1e-4)
    assert torch.allclose(torch.tensor(generated["logprobs"]["token_logprobs"]), torch.tensor(expected[-6:]),
                          atol=1e-4)
    for i in range(1, len(ids)):  # the 3 alternatives (+ the chosen one) are transformers' top 3 there
        top = ref[i - 1].topk(3)
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(top.values[0].item(), abs=1e-4)
        assert 1 <= len(lp["top_logprobs"][i]) <= 4  # texts shared by several byte tokens count once
    for i in range(len(prompt), len(ids)):  # greedy: the chosen token is the most likely one
        assert lp["token_logprobs"][i] == pytest.approx(max(lp["top_logprobs"][i].values()), abs=1e-6)
    scored = _post(url, "/v1/completions", {"prompt": [prompt, prompt[:3]], "max_tokens": 0, "echo": True,
                                            "logprobs": 1})["choices"]  # prompt scoring alone, two prompts
    assert [len(c["logprobs"]["tokens"]) for c in scored] == [len(prompt), 3]
    assert scored[0]["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"][:len(prompt)], abs=1e-5)
    assert scored[0]["text"] == reply["text"][:len(scored[0]["text"])]


def test_chat_logprobs_equal_the_completion_of_the_rendered_prompt(served: dict[str, Any]) -> None:
    """Chat ``logprobs`` + ``top_logprobs``: one entry per reply token, exactly ``top_logprobs`` alternatives, and
    the same values as /v1/completions on the chat template's text (whose values the test above checks)."""
    from crosstrain.plugins.rlhf.data import GENERATION_PROMPT, render_messages

    url, messages = served["url"], [{"role": "user", "content": "hi"}]
    chat = _post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 5, "temperature": 0,
                                               "logprobs": True, "top_logprobs": 2})["choices"][0]
    content = chat["logprobs"]["content"]
    text = render_messages(messages) + GENERATION_PROMPT
    plain = _post(url, "/v1/completions", {"prompt": text, "max_tokens": 5, "temperature": 0, "logprobs": 2,
                                           "stop": ["\n<|", "<|"]})["choices"][0]
    assert chat["message"]["content"] == plain["text"] and len(content) == len(plain["logprobs"]["tokens"])
    assert [e["logprob"] for e in content] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-6)
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in content)
    assert all(e["logprob"] == pytest.approx(e["top_logprobs"][0]["logprob"], abs=1e-6) for e in content)
    off = _post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 5, "temperature": 0})
    assert off["choices"][0]["logprobs"] is None
