"""Issue 39: no request body reaches a 500 or is silently ignored. A real ``crosstrain serve`` (uvicorn on a
thread, 127.0.0.1) over a tiny run, driven by raw HTTP and the ``openai`` SDK: wrong types, out-of-range seeds,
lone surrogates, oversized stop lists, parameters the server does not implement and non-text content parts each
get one OpenAI-style 400 naming the parameter, and the server keeps answering with unchanged text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

OVERRIDES = ["train.seq_len=32", "train.batch_size=4", "model.n_layers=1", "logging.every=100"]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer
    from crosstrain.plugins.serve.config import ServeOptions
    from crosstrain.plugins.serve.server import Server

    run = tmp_path_factory.mktemp("serve_validation") / "run"
    Trainer(load_config(None, ["train.steps=2", *OVERRIDES]), run_dir=run).fit()
    with Server(ServeOptions(str(run), port=0, max_batch=4, max_wait_ms=5, threads=1)) as server:
        yield server.url


def _post(url: str, path: str, body: Any) -> httpx.Response:
    """``body`` as JSON with non-ASCII escaped (a lone surrogate travels as ``\\udXXX``, as a JS client sends it)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=60)


#: (endpoint, body, param the error names, a word of its message)
REFUSED = [
    ("completions", {"prompt": "a", "seed": 2**64}, "seed", "less than or equal"),
    ("completions", {"prompt": "a", "seed": -1}, "seed", "greater than or equal"),
    ("completions", {"prompt": "a", "stream": "yes"}, "stream", "boolean"),
    ("completions", {"prompt": "a", "stream": 1}, "stream", "boolean"),
    ("completions", {"prompt": "a", "max_tokens": "4"}, "max_tokens", "integer"),
    ("completions", {"prompt": "a", "max_tokens": 4.0}, "max_tokens", "integer"),
    ("completions", {"prompt": "a", "temperature": "0"}, "temperature", "number"),
    ("completions", {"prompt": "a", "echo": "true"}, "echo", "boolean"),
    ("completions", {"prompt": "a", "logprobs": True}, "logprobs", "integer"),
    ("completions", {"prompt": "a", "logprobs": 21}, "logprobs", "less than or equal"),
    ("completions", {"prompt": "a", "stop": ["x"] * 17}, "stop", "at most 16"),
    ("completions", {"prompt": "a", "stop": "y" * 257}, "stop", "at most 256"),
    ("completions", {"prompt": "a", "best_of": 2}, "best_of", "not supported"),
    ("completions", {"prompt": "a", "n": 2}, "n", "not supported"),
    ("completions", {"prompt": "a", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ("completions", {"prompt": "a", "frequency_penalty": -1}, "frequency_penalty", "not supported"),
    ("completions", {"prompt": "a", "logit_bias": {"5": 10}}, "logit_bias", "not supported"),
    ("completions", {"prompt": "a", "suffix": "end"}, "suffix", "not supported"),
    ("completions", {"prompt": "a", "best_of": True}, "best_of", "not supported"),  # True == 1, but not an int
    ("completions", {"prompt": "a", "no_such_thing": 1}, "no_such_thing", "unknown parameter"),
    ("completions", {"prompt": "a", "echo": True, "stream": True}, None, "echo is not streamed"),
    ("completions", {"prompt": "a", "logprobs": 1, "stream": True}, None, "logprobs are not streamed"),
    ("completions", {"prompt": "\ud800abc"}, "prompt", "surrogate"),
    ("completions", {"prompt": ["ok", "\udfff"]}, "prompt", "surrogate"),
    ("completions", {"prompt": "a", "stop": ["\ud83d"]}, "stop", "surrogate"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages", "surrogate"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools", "not supported"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
     "response_format", "not supported"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo", "unknown parameter"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, None,
     "top_logprobs needs logprobs=true"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs", "boolean"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages", "only text content parts"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages", "text"),
]


def test_refused_bodies_get_one_openai_400_naming_the_parameter(url: str) -> None:
    before = _post(url, "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 0}).json()
    for endpoint, body, param, word in REFUSED:
        r = _post(url, f"/v1/{endpoint}", body)
        assert r.status_code == 400, (body, r.status_code, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
        assert word in error["message"] and "\n" not in error["message"], (body, error)
    r = _post(url, "/v1/completions", b'{"prompt": "a\xed\xa0\x80"}')  # a surrogate encoded as UTF-8 bytes
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    after = _post(url, "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 0}).json()
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'status="500"' not in metrics


def test_off_values_and_edges_are_accepted(url: str) -> None:
    """The "off" value of each unimplemented parameter is accepted (clients send defaults), a seed of 2**64 - 1 is
    accepted and reproducible, 16 stop strings of 256 characters are accepted, and chat text parts are joined."""
    greedy = {"prompt": "Hello", "max_tokens": 6, "temperature": 0}
    text = _post(url, "/v1/completions", greedy).json()["choices"][0]["text"]
    off = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "suffix": None,
           "user": "someone", "seed": 2**64 - 1, "stop": ["\x00" * 256] * 16}
    r = _post(url, "/v1/completions", {**greedy, **off})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
    sampled = [_post(url, "/v1/completions", {"prompt": "Hello", "max_tokens": 6, "seed": 2**64 - 1}).json()
               for _ in range(2)]
    assert sampled[0]["choices"][0]["text"] == sampled[1]["choices"][0]["text"]
    chat = {"max_tokens": 6, "temperature": 0, "tools": [], "response_format": {"type": "text"}}
    plain = _post(url, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi\nthere"}]})
    parts = _post(url, "/v1/chat/completions", {**chat, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]})
    assert plain.status_code == 200 and parts.status_code == 200, parts.text
    assert parts.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_openai_sdk_content_parts_and_refusal(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=None, messages=[  # type: ignore[arg-type]
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=4, temperature=0)
    assert isinstance(reply.choices[0].message.content, str)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=None, prompt="a", best_of=3, max_tokens=2)  # type: ignore[arg-type]
    assert caught.value.body["param"] == "best_of"  # type: ignore[index]
