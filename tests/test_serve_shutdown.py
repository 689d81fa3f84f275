"""Issue 39: latency and graceful shutdown of ``crosstrain serve``. Every accepted connection has TCP_NODELAY (so no
reply waits on the client's delayed-ACK timer); SIGTERM during 32 streams on a real ``crosstrain serve`` process
(onnxruntime, so its per-version temp dir holds an exported ONNX file) ends every stream with ``[DONE]``, each
after its last chunk or an SSE error event (the one decoding
finishes in the grace period, the queue's tail is ended), exits 0 with one line and leaves no temp file."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

OVERRIDES = ["train.seq_len=32", "train.batch_size=4", "logging.every=100"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    path = tmp_path_factory.mktemp("serve_shutdown") / "run"
    Trainer(load_config(None, ["train.steps=1", *OVERRIDES]), run_dir=path).fit()
    return path


def test_every_accepted_connection_has_tcp_nodelay(run: Path) -> None:
    from crosstrain.plugins.serve.config import ServeOptions
    from crosstrain.plugins.serve.server import Server

    with Server(ServeOptions(str(run), port=0, max_batch=2, threads=1)) as server:
        clients = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        try:
            for c in clients:  # a keep-alive request each, so every connection is open and accepted
                c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert c.recv(65536).startswith(b"HTTP/1.1 200")
            connections = list(server._uvicorn.server_state.connections)  # the server's side of each socket
            assert len(connections) == 3
            flags = [p.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                     for p in connections]
            assert all(flags), flags
        finally:
            for c in clients:
                c.close()


def test_bad_grace_period_is_one_line_exit_2(run: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "crosstrain", "serve", str(run), "--shutdown-grace-s", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "crosstrain: error: --shutdown-grace-s must lie in [0, 3600] seconds, got -1.0"]


def _stream(url: str, i: int, n: int, started: threading.Semaphore, decoding: threading.Event,
            signalled: threading.Event, out: list[Any]) -> None:
    """One stream's ``data:`` payloads in order and whether its first one came before the signal (or the exception
    that cut it)."""
    events: list[str] = []
    early = False
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                          json={"prompt": f"stream {i}: ", "max_tokens": n, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            started.release()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not events:
                        early = not signalled.is_set()
                        decoding.set()
                    events.append(line[len("data: "):])
        out[i] = (events, early)
    except Exception as exc:  # recorded, so the assertion names it
        out[i] = exc


def test_sigterm_during_32_streams_drains_and_exits_0(run: Path, tmp_path: Path) -> None:
    """--max-batch 1: one stream decodes, 31 wait. Each stream is sized from a measured request to take about a fifth
    of the 1 s grace period (at most 240 tokens), so the one decoding at the signal finishes within it and the 31
    queued behind it cannot all: the queue's tail is ended by the grace period."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-m", "crosstrain", "serve", str(run), "--port", "0", "--engine", "onnxruntime",
           "--max-batch", "1", "--threads", "1", "--shutdown-grace-s", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"})
    assert proc.stdout is not None
    try:
        banner = proc.stdout.readline()
        match = re.search(r"http://[\d.]+:\d+", banner)
        assert match, banner + proc.communicate(timeout=60)[1][-2000:]
        url = match.group(0)
        # the per-version temp dir with the exported ONNX file, which the shutdown must remove
        assert [p.name for p in tmp.glob("crosstrain-serve-*/*.onnx")] == ["v1.onnx"]
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "warm up", "max_tokens": 240, "temperature": 0},
                       timeout=120)
        tokens_per_s = r.json()["usage"]["completion_tokens"] / (time.perf_counter() - t0)
        n = max(8, min(240, int(tokens_per_s * 1.0 / 5)))
        started, decoding, signalled = threading.Semaphore(0), threading.Event(), threading.Event()
        out: list[Any] = [None] * 32
        threads = [threading.Thread(target=_stream, args=(url, i, n, started, decoding, signalled, out))
                   for i in range(32)]
        for t in threads:
            t.start()
        for _ in range(32):  # every connection accepted and answering before the signal
            assert started.acquire(timeout=120)
        assert decoding.wait(timeout=120)
        signalled.set()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
        for t in threads:
            t.join(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"crosstrain serve: stopped on SIGTERM; \d+ of \d+ replies in flight finished, \d+ ended "
                        r"after the 1 s grace period", last), stderr[-2000:]
    finished = ended = 0
    for result in out:
        assert isinstance(result, tuple), result
        events, early = result
        assert len(events) >= 2 and events[-1] == "[DONE]", events
        body = json.loads(events[-2])
        if "error" in body:
            assert not early, "a stream decoding at the signal was ended instead of finishing in the grace period"
            assert "shutting down" in body["error"]["message"] and body["error"]["type"] == "server_error"
            ended += 1
        else:
            assert body["choices"][0]["finish_reason"] in ("length", "stop")
            finished += 1
    assert sum(early for _, early in out) >= 1 and ended >= 1, (finished, ended, last, n)
    # nothing of the server's is left; onnxruntime itself keeps a 51-byte session-id file, $TMPDIR/.ses, written at
    # import and shared by every process (as /tmp/.ses on this machine): not a temp file of this server
    assert sorted(p.name for p in tmp.iterdir()) in ([], [".ses"])
