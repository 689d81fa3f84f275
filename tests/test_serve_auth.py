"""``crosstrain serve`` authenticates its clients (crosstrain.plugins.serve.auth): with ``CROSSTRAIN_API_KEY`` set,
a real server process answers the openai SDK that sends the key and refuses, with OpenAI's 401, one that sends
none or another; ``/health`` stays open for probes. Listening beyond loopback without a key is one line, exit 2,
before anything binds or loads."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")

from serve_process import ServeProcess, serve_process  # noqa: E402

KEY = "test-key-5f1c"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    root = tmp_path_factory.mktemp("serve_auth")
    Trainer(load_config(None, ["train.steps=1", "train.seq_len=32", "train.batch_size=4", "model.n_layers=1"]),
            run_dir=root / "run").fit()
    with serve_process([str(root / "run"), "--threads", "1"], root / "serve.log", api_key=KEY) as server:
        yield server


def test_the_key_is_required_on_every_v1_route_and_health_stays_open(server: ServeProcess) -> None:
    import openai

    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    reply = good.completions.create(model=None, prompt="a", max_tokens=2, temperature=0)  # type: ignore[arg-type]
    assert reply.choices[0].text is not None
    for wrong in ("other-key", KEY + "x", KEY[:-1]):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=wrong, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as caught:
            client.models.list()
        assert caught.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "a"}, timeout=30).status_code == 401  # none
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_listening_beyond_loopback_without_a_key_is_one_line_before_anything(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CROSSTRAIN_API_KEY"}
    out = subprocess.run([sys.executable, "-m", "crosstrain", "serve", str(tmp_path / "missing_run"), "--host",
                          "0.0.0.0", "--port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "CROSSTRAIN_API_KEY" in lines[0] and "127.0.0.1" in lines[0], out.stderr
    assert list(tmp_path.iterdir()) == []
