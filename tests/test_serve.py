"""``crosstrain serve`` end to end: one in-process server (uvicorn on a thread, a real socket on 127.0.0.1) over a
tiny run, driven by the official ``openai`` client and raw HTTP; the run is resumed by a real ``crosstrain train``
process while a client keeps sending requests, and the server hot-swaps to the new checkpoint."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

OVERRIDES = ["train.seq_len=32", "train.batch_size=4", "model.n_layers=1", "checkpoint.every=2", "logging.every=100"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer
    from crosstrain.plugins.serve.config import ServeOptions
    from crosstrain.plugins.serve.server import Server

    run = tmp_path_factory.mktemp("serve") / "run"
    Trainer(load_config(None, ["train.steps=2", *OVERRIDES]), run_dir=run).fit()
    # one torch thread: the tiny model's ops are too small to split, and threads only wait on each other
    server = Server(ServeOptions(str(run), port=0, watch=True, poll_s=0.5, max_batch=8, max_wait_ms=20, threads=1))
    with server:
        yield {"run": run, "server": server, "url": server.url, "name": server.name}


def _models(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]


def _complete(url: str, prompt: Any, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                   **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_client_greedy_equals_crosstrain_generate(served: dict[str, Any]) -> None:
    import openai

    from crosstrain.cli.main import main

    client = openai.OpenAI(base_url=f"{served['url']}/v1", api_key="unused")
    reply = client.completions.create(model=served["name"], prompt="Hello", max_tokens=16, temperature=0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", str(served["run"] / "checkpoints" / "step_2"), "--prompt", "Hello",
                     "--max-new-tokens", "16", "--json"]) == 0
    assert reply.choices[0].text == json.loads(out.getvalue())["text"]
    assert reply.usage is not None and reply.usage.completion_tokens == 16 and reply.usage.prompt_tokens == 5
    stream = client.completions.create(model=served["name"], prompt="Hello", max_tokens=16, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == reply.choices[0].text
    chat = client.chat.completions.create(model=served["name"], messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
    model = client.models.list().data[0]
    assert model.id == served["name"] and model.step == 2 and len(model.params_sha256) == 64  # type: ignore[attr-defined]


def _batched_steps(url: str) -> float:
    """Decode steps so far that carried more than one sequence (from the batch-size histogram)."""
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(("crosstrain_serve_batch_size_count", 'crosstrain_serve_batch_size_bucket{le="1.0"}')):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples["crosstrain_serve_batch_size_count"] - samples['crosstrain_serve_batch_size_bucket{le="1.0"}']


def test_concurrent_greedy_requests_equal_each_served_alone(served: dict[str, Any]) -> None:
    """8 prompts of different lengths and budgets at once (continuous batching) vs one at a time: same text; token
    id prompts too; a stop string ends the text before it."""
    url = served["url"]
    prompts: list[Any] = ["a", "The quick brown fox", "Hello, world", "x" * 40, [72, 105], "serve", "0123456789", "ok"]
    budgets = [5, 20, 9, 14, 11, 3, 17, 8]
    alone = [_complete(url, p, n)["choices"][0]["text"] for p, n in zip(prompts, budgets, strict=True)]
    before = _batched_steps(url)
    with ThreadPoolExecutor(len(prompts)) as pool:
        pairs = zip(prompts, budgets, strict=True)
        together = list(pool.map(lambda pn: _complete(url, *pn)["choices"][0]["text"], pairs))
    assert together == alone
    assert _batched_steps(url) > before  # some decode steps really did carry several sequences
    several = _complete(url, ["a", "ok"], 5)["choices"]  # a list of prompts: one choice each, in order
    assert [c["text"] for c in several] == [alone[0], _complete(url, "ok", 5)["choices"][0]["text"]]
    text = alone[1]
    stop = next(c for c in text if c != "\ufffd")  # the text ends before its first occurrence
    cut = _complete(url, prompts[1], budgets[1], stop=stop)["choices"][0]
    assert cut["text"] == text[:text.index(stop)] and cut["finish_reason"] == "stop"


BAD = [
    ({"model": "nope", "prompt": "a"}, 404, "model"),
    ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "a" * 300}, 400, "prompt"),
    ({"prompt": "a" * 250, "max_tokens": 10}, 400, "max_tokens"),
    ({"prompt": [999]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served: dict[str, Any]) -> None:
    url = served["url"]
    for body, status, param in BAD:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], error
    for raw in (b"{not json", b"[1, 2]", b""):
        r = httpx.post(f"{url}/v1/chat/completions", content=raw, timeout=30)
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert httpx.get(f"{url}/v1/nothing", timeout=30).status_code == 404
    assert _complete(url, "still here", 4)["choices"][0]["finish_reason"] == "length"
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    for name in ("crosstrain_serve_requests_total", "crosstrain_serve_generation_tokens_total",
                 "crosstrain_serve_num_requests_waiting", "crosstrain_serve_batch_size_bucket",
                 "crosstrain_serve_e2e_request_latency_seconds_bucket", "crosstrain_serve_model_step 2.0"):
        assert name in metrics, name
    assert 'status="400"' in metrics and 'status="500"' not in metrics


def test_port_in_use_is_one_line_exit_2(served: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from one_line import one_line_error

    from crosstrain.cli.main import main

    assert main(["serve", str(served["run"]), "--port", str(served["server"].port)]) == 2
    captured = capsys.readouterr()
    assert "port is in use" in one_line_error(captured.out, captured.err, lines=1)[0]


def test_onnxruntime_engine_serves_the_same_tokens(served: dict[str, Any]) -> None:
    """--engine onnxruntime: the checkpoint is exported, gated (ONNX vs torch logits) and gives the torch engine's
    greedy text, and with a seed the same sampled text."""
    from crosstrain.plugins.serve.config import ServeOptions
    from crosstrain.plugins.serve.server import Server

    with Server(ServeOptions(str(served["run"] / "checkpoints" / "step_2"), port=0, engine="onnxruntime",
                             threads=1)) as ort:
        gate = ort.manager.current.gate
        assert gate.passed and gate.max_abs_err is not None and gate.max_abs_err <= 1e-4
        for extra in ({}, {"temperature": 0.8, "top_k": 20, "seed": 7}):
            assert _complete(ort.url, "Hello", 12, **extra)["choices"][0]["text"] == \
                _complete(served["url"], "Hello", 12, **extra)["choices"][0]["text"]
        exported = ort.manager.workdir / "v1.onnx"  # the export it serves, given as SOURCE itself
        with Server(ServeOptions(str(exported), port=0, engine="onnxruntime", threads=1)) as onnx_file:
            assert _models(onnx_file.url)["step"] is None and onnx_file.manager.current.gate.passed
            assert _complete(onnx_file.url, "Hello", 12)["choices"][0]["text"] == \
                _complete(served["url"], "Hello", 12)["choices"][0]["text"]


def _client(url: str, stop: threading.Event, log: list[tuple[int, int | None]]) -> None:
    """Requests back to back until ``stop``: (HTTP status, step that served it) each."""
    while not stop.is_set():
        try:
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 6, "temperature": 0},
                           timeout=120)
            fingerprint = r.json().get("system_fingerprint") or "" if r.status_code == 200 else ""
            step = int(fingerprint.split("-")[1]) if fingerprint.startswith("step-") else None
            log.append((r.status_code, step))
        except httpx.HTTPError:
            log.append((-1, None))


def _wait_for(predicate: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return bool(predicate())


def test_watch_swaps_in_the_resumed_run_and_refuses_bad_checkpoints(served: dict[str, Any]) -> None:
    """The run resumed to step 4 by a real `crosstrain train` is served within 90 s of its checkpoint committing,
    with no failed request from a client sending throughout; then a byte-flipped checkpoint and one whose recorded
    eval loss is NaN are refused, and step 4 keeps serving."""
    url, run = served["url"], served["run"]
    stop, log = threading.Event(), []  # type: ignore[var-annotated]
    client = threading.Thread(target=_client, args=(url, stop, log))
    client.start()
    try:
        cmd = [sys.executable, "-m", "crosstrain", "train", "--run-dir", str(run), "--set", "train.steps=4",
               *[a for o in OVERRIDES for a in ("--set", o)]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        committed = max(e["time"] for e in events if e.get("event") == "checkpoint" and e.get("step") == 4)
        assert _wait_for(lambda: _models(url)["step"] == 4, max(0.0, committed + 90 - time.time()))
        assert _models(url)["loaded_at"] - committed <= 90
        assert _wait_for(lambda: any(step == 4 for _, step in log), 120)
    finally:
        stop.set()
        client.join()
    assert log and all(status == 200 for status, _ in log), log
    assert {step for _, step in log} == {2, 4}

    # each bad checkpoint is made beside the run and renamed in whole, as the trainer commits one: the watcher
    # polling every 0.5 s must never see a half-copied folder (it would refuse that for its missing manifest)
    ckpts, staging = run / "checkpoints", run.parent / "staging"
    staging.mkdir()
    shutil.copytree(ckpts / "step_4", staging / "step_6")
    data = staging / "step_6" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    (staging / "step_6").rename(ckpts / "step_6")
    with (run / "metrics.jsonl").open("a") as fh:  # recorded before its checkpoint appears
        fh.write('{"step": 5, "eval/loss": NaN}\n')
    shutil.copytree(ckpts / "step_4", staging / "step_5")
    (staging / "step_5").rename(ckpts / "step_5")
    health = lambda: httpx.get(f"{url}/health", timeout=30).json()  # noqa: E731
    assert _wait_for(lambda: sum(e["event"] == "refused" for e in health()["events"]) >= 2, 60)
    refused = {e["step"]: e["reason"] for e in health()["events"] if e["event"] == "refused"}
    assert "SHA-256" in refused[6] and "eval loss" in refused[5], refused
    assert _models(url)["step"] == 4
    assert _complete(url, "Hi", 6)["system_fingerprint"].startswith("step-4-")
    assert "crosstrain_serve_refused_versions_total 2.0" in httpx.get(f"{url}/metrics", timeout=30).text


def test_best_follows_the_best_pointer(served: dict[str, Any], tmp_path: Path) -> None:
    """--watch --best: the version follows the run's ``best`` pointer, and a pointer to a checkpoint that fails
    verification is not followed. Runs after the watch test (needs its step_4 and corrupt step_6)."""
    from crosstrain.plugins.serve.config import ServeOptions
    from crosstrain.plugins.serve.manager import ModelManager

    ckpts = served["run"] / "checkpoints"
    assert (ckpts / "step_4").is_dir() and (ckpts / "step_6").is_dir()
    (ckpts / "best").write_text("step_2")
    manager = ModelManager(ServeOptions(str(served["run"]), watch=True, best=True), tmp_path)
    assert manager.current.step == 2 and manager.poll() is None
    (ckpts / "best").write_text("step_4")
    swapped = manager.poll()
    assert swapped is not None and manager.current is swapped and swapped.step == 4 and swapped.gate.passed
    (ckpts / "best").write_text("step_6")  # byte-flipped: find_best does not verify it, nothing to swap to
    assert manager.poll() is None and manager.current.step == 4


def test_requests_stopped_at_their_first_token_free_their_rows(served: dict[str, Any]) -> None:
    """Issue 39: a stop string matching the first generated token ends the job right after prefill; its batch row
    must be freed, or after max_batch (8) such requests nothing is admitted again. 20 of them, then a normal one
    that must still get its unchanged text."""
    url = served["url"]
    text = _complete(url, "The quick brown fox", 10)["choices"][0]["text"]
    first = text[0]
    for _ in range(20):
        cut = httpx.post(f"{url}/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 10,
                                                        "temperature": 0, "stop": [first]}, timeout=30)
        assert cut.status_code == 200, cut.text
        assert cut.json()["choices"][0]["text"] == "" and cut.json()["choices"][0]["finish_reason"] == "stop"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 10,
                                                  "temperature": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
