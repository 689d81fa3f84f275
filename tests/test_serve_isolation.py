"""Issue 39, isolation as an invariant: whatever one request sends, the other requests complete with unchanged text
and the server stays healthy. One in-process server (uvicorn on a thread, a real socket on 127.0.0.1) over a tiny
run, driven by the official ``openai`` client and httpx; the last test is a hypothesis property test.

No request can make a decode step raise any more (validation and the temperature floor closed the known ways), so
the failure test injects one fault where the batch meets the model: :class:`PoisonedAt` wraps the real model as
``ContinuousBatch.model`` (the module the batch runs, its documented interface: ``forward_cached`` and the cache
protocol) and raises in a decode step that carries a row at position >= ``at``. The scheduler is the real one."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from crosstrain.generation import ContinuousBatch, GenerationConfig, Sequence
from crosstrain.models.gpt import build_gpt

OVERRIDES = ["train.seq_len=32", "train.batch_size=4", "model.n_layers=1", "logging.every=100"]
PROMPTS = ["a", "The quick brown fox", "Hello, world", "x" * 40, "serve", "0123456789", "ok", "zebra"]
N = 150  # new tokens per stream: a request sent after the streams' first chunks joins them while they decode
POISON_AT = 200  # a decode position only the poisoned request's 200-token prompt reaches (others: < 40 + N)


class PoisonedAt:
    """``model`` except that a decode step (one token per row) carrying a row at position >= ``at`` raises once it
    has run (the cache already moved on, as when sampling fails): a row that breaks every step it is in, as a row
    that overflows would. Counts the batched steps it broke."""

    def __init__(self, model: Any, at: int) -> None:
        self.model, self.at, self.broke_batched = model, at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def forward_cached(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any, mask: Any) -> torch.Tensor:
        logits = self.model.forward_cached(tokens, positions, cache, mask)  # first: the cache has moved on
        if tokens.shape[1] == 1 and int(positions.max()) >= self.at:
            self.broke_batched += tokens.shape[0] > 1
            raise RuntimeError(f"poisoned row at position {int(positions.max())}")
        return logits


class PoisonedEngine:
    """:class:`PoisonedAt` for an onnxruntime engine (``OrtBatch.engine``): a one-token call whose past holds
    ``at`` or more slots raises."""

    def __init__(self, engine: Any, at: int) -> None:
        self.engine, self.at = engine, at

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def forward(self, ids: Any, cache: list[Any]) -> Any:
        out = self.engine.forward(ids, cache)
        if ids.shape[1] == 1 and cache[0].shape[2] >= self.at:
            raise RuntimeError(f"poisoned row at position {cache[0].shape[2]}")
        return out


def _undone_then_alone(make: Callable[[], Any], poison: Callable[[Any, int], None],
                       state: Callable[[Any], Any] = lambda batch: None) -> None:
    """A batched step that raises leaves every row's tokens (and the batch's ``state``) as they were; each row
    stepped alone then decodes the tokens of the unpoisoned batch (greedy), and only the poisoned row fails."""
    prompts, poisoned = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [9, 10]], 1
    cfg = GenerationConfig(max_new_tokens=8, greedy=True)
    clean_batch = make()
    clean = [clean_batch.add(Sequence(p, cfg)) for p in prompts]
    while clean_batch.live:
        clean_batch.step()
    batch = make()
    seqs = [batch.add(Sequence(p, cfg)) for p in prompts]
    batch.step()
    poison(batch, len(prompts[poisoned]) + 1)  # the long row's second decode step breaks; the others never get there
    before = ([list(s.tokens) for s in seqs], state(batch))
    with pytest.raises(RuntimeError, match="poisoned"):
        batch.step()
    assert ([list(s.tokens) for s in seqs], state(batch)) == before and len(batch.live) == 3
    for seq in list(batch.live):
        if seq is seqs[poisoned]:
            with pytest.raises(RuntimeError, match="poisoned"):
                batch.step_alone(seq)
            batch.drop(seq)
        else:
            batch.step_alone(seq)
    while batch.live:
        batch.step()
    assert [s.tokens for s in seqs] == [c.tokens if c is not clean[poisoned] else c.tokens[:2] for c in clean]


def test_a_step_that_raises_is_undone_and_rows_step_alone_to_the_same_tokens() -> None:
    """ContinuousBatch (torch): also every row's cache length is back where it was after the failed step."""
    torch.manual_seed(0)
    model = build_gpt("tiny", n_layers=2, n_kv_heads=2, max_seq_len=64).eval()
    model.init_weights()

    def poison(batch: ContinuousBatch, at: int) -> None:
        batch.model = PoisonedAt(model, at)

    _undone_then_alone(lambda: ContinuousBatch(model, 4), poison, lambda batch: list(batch.cache.lengths))


def test_the_onnxruntime_batch_undoes_a_failed_step_too(served: dict[str, Any], tmp_path: Path) -> None:
    """OrtBatch: each sequence's ``present`` arrays go back to those before the failed step."""
    from crosstrain.plugins.export.generate import OrtEngine
    from crosstrain.plugins.export.loading import load_model
    from crosstrain.plugins.export.onnx_export import export_onnx
    from crosstrain.plugins.serve.ort_batch import OrtBatch

    engine = OrtEngine(export_onnx(load_model(served["run"]), tmp_path / "m.onnx").path)

    def poison(batch: OrtBatch, at: int) -> None:
        batch.engine = PoisonedEngine(engine, at)

    _undone_then_alone(lambda: OrtBatch(engine, 4), poison)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer
    from crosstrain.plugins.serve.config import ServeOptions
    from crosstrain.plugins.serve.server import Server

    run = tmp_path_factory.mktemp("iso") / "run"
    Trainer(load_config(None, ["train.steps=2", *OVERRIDES]), run_dir=run).fit()
    server = Server(ServeOptions(str(run), port=0, max_batch=16, max_wait_ms=20, threads=1))
    with server:
        url = server.url
        solo = {p: _complete(url, p, N)["choices"][0]["text"] for p in PROMPTS}
        yield {"server": server, "url": url, "name": server.name, "solo": solo, "run": run}


def _complete(url: str, prompt: Any, max_tokens: int, **extra: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                   **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _stream_text(url: str, name: str, prompt: str, max_tokens: int, started: threading.Barrier | None) -> str:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    parts = []
    for chunk in client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True):
        parts.append(chunk.choices[0].text)
        if started is not None and len(parts) == 1:
            started.wait(timeout=120)
    return "".join(parts)


def _idle(url: str) -> dict[str, Any]:
    """/health once no sequence is in flight (a cancelled stream leaves at the scheduler's next step)."""
    event = threading.Event()
    for _ in range(200):
        health = httpx.get(f"{url}/health", timeout=30).json()
        if health["running"] == 0:
            return dict(health)
        event.wait(0.05)
    return dict(health)


def _beside_streams(served: dict[str, Any], intruder: Any) -> tuple[list[str], Any]:
    """8 greedy streams; once each has its first chunk, ``intruder(url)`` runs beside them. Their texts and its
    result."""
    url, name = served["url"], served["name"]
    started = threading.Barrier(len(PROMPTS) + 1)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = [pool.submit(_stream_text, url, name, p, N, started) for p in PROMPTS]
        started.wait(timeout=120)
        result = intruder(url)
        return [s.result(timeout=120) for s in streams], result


def test_a_2e_38_temperature_beside_8_streams_leaves_them_unchanged(served: dict[str, Any]) -> None:
    """Issue 39's probe: ``temperature=2e-38`` overflowed ``logits / temperature`` and its multinomial failed all 8
    streams beside it. Now it is greedy (below MIN_TEMPERATURE) and every stream has its solo greedy text. The tiny
    model's logits are small enough that 2e-38 alone would not overflow them, so 1e-40 (an fp32 subnormal) and
    1e-300 (0 in fp32) go with it: without the floor those two raise in the sampler."""
    def tiny_temperatures(url: str) -> list[httpx.Response]:
        with ThreadPoolExecutor(3) as pool:
            return list(pool.map(lambda t: httpx.post(f"{url}/v1/completions", json={
                "prompt": "serve", "max_tokens": N, "temperature": t}, timeout=120), (2e-38, 1e-40, 1e-300)))

    texts, replies = _beside_streams(served, tiny_temperatures)
    assert texts == [served["solo"][p] for p in PROMPTS]
    assert [r.status_code for r in replies] == [200] * 3, [r.text for r in replies]
    assert [r.json()["choices"][0]["text"] for r in replies] == [served["solo"]["serve"]] * 3
    assert _idle(served["url"])["running"] == 0


def test_a_request_that_breaks_the_batched_step_fails_only_itself(served: dict[str, Any]) -> None:
    """A row that makes every step it is in raise (PoisonedAt) joins 8 decoding streams, once as a plain request
    (an OpenAI 500 ``server_error`` body) and once as a stream (an SSE error event, then ``[DONE]``); the 8 streams
    keep their solo greedy text, and the server serves on."""
    batch = served["server"].manager.current.batch
    poisoned = PoisonedAt(batch.model, POISON_AT)
    long_prompt = "p" * POISON_AT
    batch.model = poisoned
    try:
        def plain(url: str) -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", json={"prompt": long_prompt, "max_tokens": 8,
                                                             "temperature": 0}, timeout=120)

        texts, reply = _beside_streams(served, plain)
        assert texts == [served["solo"][p] for p in PROMPTS]
        assert reply.status_code == 500, reply.text
        error = reply.json()["error"]
        assert error["type"] == "server_error" and "poisoned row" in error["message"]

        def streamed(url: str) -> list[str]:
            with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": long_prompt, "max_tokens": 8,
                                                                     "temperature": 0, "stream": True},
                              timeout=120) as r:
                assert r.status_code == 200
                return [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]

        texts, events = _beside_streams(served, streamed)
        assert texts == [served["solo"][p] for p in PROMPTS]
        assert events[-1] == "[DONE]" and "poisoned row" in json.loads(events[-2])["error"]["message"]
        assert poisoned.broke_batched >= 2  # the fault really hit steps shared with the streams
    finally:
        batch.model = poisoned.model
    assert _idle(served["url"])["running"] == 0
    assert _complete(served["url"], "serve", N)["choices"][0]["text"] == served["solo"]["serve"]


# -- the property: random and adversarial requests beside a steady client -----------------------------------------
_NUMBER = st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=64), st.sampled_from([0, 2e-38, 1e-300,
                    1e-5, 1, 2, 1e300, -1]), st.integers(-(2**70), 2**70))
_TEXT = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(["\ud800", "a\udfffb", "\x00", "é" * 20])
_STOP = st.one_of(st.none(), _TEXT, st.lists(_TEXT, max_size=20),
                  st.just(["s" * 500] * 2000), st.just(["\ud800"]), st.integers())
_WILD = st.fixed_dictionaries(  # anything: most of these are refused (400), some pass
    {"prompt": st.one_of(_TEXT, st.lists(st.integers(-5, 600), max_size=8), st.just("p" * 300))},
    optional={"max_tokens": st.one_of(st.integers(-3, 24), st.just(10**9), st.text(max_size=3)),
              "temperature": _NUMBER, "top_p": _NUMBER, "top_k": st.one_of(st.integers(-3, 600), _NUMBER),
              "seed": st.one_of(st.integers(-(2**65), 2**65), st.sampled_from([2**64 - 1, 2**64])),
              "stop": _STOP, "stream": st.one_of(st.booleans(), st.just("yes")), "logprobs": st.integers(-1, 25),
              "echo": st.booleans(), "n": st.integers(0, 3), "best_of": st.integers(0, 3),
              "presence_penalty": _NUMBER, "bogus": st.integers()})
_EDGE = st.fixed_dictionaries(  # valid bodies at the edges of every range: these must decode (200)
    {"prompt": st.one_of(st.text(st.characters(codec="utf-8"), min_size=1, max_size=40),
                         st.lists(st.integers(0, 255), min_size=1, max_size=8)),
     "max_tokens": st.integers(0, 24)},
    optional={"temperature": st.one_of(st.sampled_from([0, 2e-38, 1e-300, 1e-5, 1.0000001e-5, 1e6, 1e300]),
                                       st.floats(0, 4)),
              "top_p": st.one_of(st.sampled_from([1e-300, 1e-9, 1]), st.floats(0, 1, exclude_min=True)),
              "top_k": st.integers(-1, 600), "seed": st.integers(0, 2**64 - 1),
              "stop": st.lists(st.text(st.characters(codec="utf-8"), max_size=256), max_size=16),
              "stream": st.booleans()})


def _send(url: str, body: dict[str, Any], chat: bool, abort: bool) -> int:
    """POST ``body`` raw (lone surrogates escaped, as a client's JSON encoder would send them), with ``chat`` to the
    chat endpoint (the prompt as the user's message; echo and logprobs as they are: chat refuses an int logprobs);
    a stream is read to its end, or with ``abort`` closed after its first event. The status."""
    endpoint = "completions"
    if chat:
        endpoint, prompt = "chat/completions", body.pop("prompt")
        body["messages"] = [{"role": "user", "content": prompt}]
    raw = json.dumps(body)  # ensure_ascii: "\ud800" travels as the escape, which the server must refuse
    headers = {"content-type": "application/json"}
    with httpx.stream("POST", f"{url}/v1/{endpoint}", content=raw, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if abort and line.startswith("data: "):
                break
        return r.status_code


def test_no_request_breaks_another_or_the_server(served: dict[str, Any]) -> None:
    """Hypothesis drives random and adversarial bodies (parameters in and out of range, stop strings and a 2000 x
    500 stop list, lone surrogates, token ids outside the vocabulary, streams and aborted streams) while a steady
    client repeats one greedy request: every reply is 2xx or 4xx (never a 5xx, never past the 60 s client timeout),
    every steady reply has its solo text, /health is ok at the end and no row is left busy."""
    url = served["url"]
    stop, steady, steady_codes, statuses = threading.Event(), [], [], []
    alone = _complete(url, "The quick brown fox", 24)["choices"][0]["text"]

    def steady_client() -> None:
        while not stop.is_set():
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 24,
                                                          "temperature": 0}, timeout=60)
            steady_codes.append(r.status_code)
            if r.status_code == 200:
                steady.append(r.json()["choices"][0]["text"])

    @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(body=_WILD | _EDGE, chat=st.booleans(), abort=st.booleans())
    @example(body={"prompt": "a", "max_tokens": 8, "temperature": 2e-38, "stream": True}, chat=False, abort=False)
    @example(body={"prompt": "0", "max_tokens": 1, "top_p": 1e-300}, chat=False, abort=False)  # once a 500
    @example(body={"prompt": "a", "stop": ["s" * 500] * 2000}, chat=True, abort=False)
    @example(body={"prompt": "a\ud800", "max_tokens": 4}, chat=False, abort=False)
    @example(body={"prompt": "Hello", "max_tokens": 24, "stream": True}, chat=True, abort=True)
    def one_request(body: dict[str, Any], chat: bool, abort: bool) -> None:
        status = _send(url, body, chat, abort)
        statuses.append(status)
        assert 200 <= status < 500, (status, body)

    thread = threading.Thread(target=steady_client, daemon=True)
    thread.start()
    try:
        one_request()
    finally:
        stop.set()
        thread.join(timeout=120)
    assert 200 in statuses and 400 in statuses  # both kinds were really driven
    assert steady and set(steady) == {alone} and set(steady_codes) == {200}
    health = _idle(url)
    assert health["status"] == "ok" and health["running"] == 0
    assert served["server"].manager.current.batch.free == 16  # every row released
