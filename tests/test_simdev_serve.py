"""``crosstrain generate`` and ``crosstrain serve`` (torch engine) compute on the selected backend's device: on
simdev (a software device whose tensors are not host memory) they give the cpu backend's tokens, greedy and seeded
(simdev's generator draws what the CPU's draws from a seed), and say where they ran (``--json``'s and
``/v1/models``' ``backend`` and ``device``). simdev is a test device, not hardware: this proves these paths never
assume the host, not anything about a chip."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from simdev_env import crosstrain_on, needs_simdev

BACKENDS = ("cpu", "simdev")
DEVICES = {"cpu": "cpu", "simdev": "simdev:0"}
SAMPLED = {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 7}


pytestmark = needs_simdev


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny trained run (2 steps on cpu, fp32) whose checkpoint both backends load."""
    run = tmp_path_factory.mktemp("simdev_serve") / "run"
    keys = ["model.n_layers=1", "model.dim=32", "model.n_heads=2", "train.batch_size=4", "train.seq_len=32",
            "train.steps=2", "eval.every=0", "checkpoint.every=0", "logging.progress=none",
            "logging.tensorboard=false", "precision.dtype=fp32", "kernels.mode=reference", "optim.impl=torch"]
    proc = crosstrain_on("cpu", ["train", "--run-dir", str(run), *[a for k in keys for a in ("--set", k)]])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    return run


def _generate_both(run: Path, extra: list[str]) -> dict[str, dict]:
    """``crosstrain generate --json`` once per backend, side by side."""
    argv = ["generate", str(run), "--prompt", "Hello", "--max-new-tokens", "12", "--json", *extra]
    procs = {b: crosstrain_on(b, argv) for b in BACKENDS}
    out = {}
    for b, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stdout + stderr
        out[b] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_generate_on_simdev_equals_cpu(run: Path, mode: str) -> None:
    extra = [] if mode == "greedy" else [a for k, v in SAMPLED.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    out = _generate_both(run, extra)
    for b in BACKENDS:
        assert (out[b]["engine"], out[b]["backend"], out[b]["device"]) == ("torch", b, DEVICES[b])
    assert len(out["cpu"]["new_ids"]) == 12
    assert out["simdev"]["new_ids"] == out["cpu"]["new_ids"]
    assert out["simdev"]["text"] == out["cpu"]["text"]


@pytest.fixture(scope="module")
def servers(run: Path) -> Iterator[dict[str, str]]:
    """``crosstrain serve`` (torch engine) on each backend, on free ports: backend -> base URL."""
    procs = {b: crosstrain_on(b, ["serve", str(run), "--port", "0", "--threads", "1", "--shutdown-grace-s", "1"])
             for b in BACKENDS}
    try:
        urls = {}
        for b, proc in procs.items():
            assert proc.stdout is not None
            banner = proc.stdout.readline()
            match = re.search(r"http://[\d.]+:\d+", banner)
            assert match, banner + (proc.communicate(timeout=60)[1][-2000:] if proc.poll() is not None else "")
            urls[b] = match.group(0)
        yield urls
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def test_serve_on_simdev_answers_as_cpu(run: Path, servers: dict[str, str]) -> None:
    for b, url in servers.items():
        model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]
        assert (model["engine"], model["backend"], model["device"]) == ("torch", b, DEVICES[b])
        assert model["gate"]["passed"], model["gate"]
    # greedy with the prompt scored and 2 alternatives per token (log-probs computed on the device), then seeded
    for body in ({"temperature": 0, "logprobs": 2, "echo": True}, SAMPLED):
        choices = {}
        for b, url in servers.items():
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 12, **body}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 12
            choices[b] = r.json()["choices"][0]
        assert choices["simdev"]["text"] == choices["cpu"]["text"], body
        if "logprobs" in body:
            cpu, sim = choices["cpu"]["logprobs"], choices["simdev"]["logprobs"]
            assert choices["cpu"]["text"].startswith("Hello") and len(cpu["tokens"]) == 5 + 12
            assert sim["tokens"] == cpu["tokens"]
            assert cpu["token_logprobs"][0] is None and sim["token_logprobs"][0] is None
            assert sim["token_logprobs"][1:] == pytest.approx(cpu["token_logprobs"][1:], rel=1e-6, abs=1e-7)
            assert [sorted(t) for t in sim["top_logprobs"][1:]] == [sorted(t) for t in cpu["top_logprobs"][1:]]
