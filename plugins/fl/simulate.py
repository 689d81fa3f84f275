"""``crosstrain fl simulate``: one server and ``fl.clients`` client processes over TLS on 127.0.0.1.

Layout of the run dir: the server's files at the top (summary.json, metrics.jsonl, global/, address),
``certs/`` (made on the first run, reused on a rerun, which resumes the server), ``clients/client-<i>/``
(each client's summary.json, log.txt and its crosstrain training run under ``train/``, whose events.jsonl
has the client's ``fl_round`` records).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.atomic import atomic_write
from crosstrain.errors import CrosstrainError


class SimulationError(CrosstrainError):
    """The simulated server did not come up or failed."""

    exit_code = 1


def _command(role: str, config_path: str | None, overrides: list[str], run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "crosstrain", "fl", role]
    if config_path:
        cmd.append(config_path)
    for item in overrides:
        cmd += ["--set", item]
    return [*cmd, "--run-dir", str(run_dir)]


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def start(config_path: str | None, overrides: list[str], config: Any, run_dir: Path,
          extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, list[subprocess.Popen]]:
    """Start the server, wait for its address, then start every client; returns the processes."""
    from crosstrain.plugins.fl.certs import generate
    from crosstrain.plugins.fl.server import fl_section

    fl = fl_section(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    certs = run_dir / "certs"
    if not (certs / "ca.crt").exists():
        generate(certs, fl.clients)
    base = [*overrides, f"fl.certs={certs}"]
    env = {**os.environ, **(extra_env or {})}
    (run_dir / "address").unlink(missing_ok=True)
    server = subprocess.Popen(_command("server", config_path, [*base, f"fl.address={fl.host_port[0]}:0"], run_dir),
                              env=env)
    deadline = time.monotonic() + 120
    while not (run_dir / "address").exists():
        if server.poll() is not None:
            raise SimulationError(f"the FL server exited with code {server.returncode} before listening")
        if time.monotonic() > deadline:
            _stop([server])
            raise SimulationError("the FL server did not start listening within 120 s")
        time.sleep(0.05)
    address = (run_dir / "address").read_text().strip()
    clients = []
    for i in range(fl.clients):
        folder = run_dir / "clients" / f"client-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "log.txt", "ab") as log:
            clients.append(subprocess.Popen(
                [*_command("client", config_path, [*base, f"fl.address={address}"], folder), "--id", str(i)],
                stdout=log, stderr=subprocess.STDOUT, env=env))
    return server, clients


def simulate(config_path: str | None, overrides: list[str], config: Any, run_dir: Path,
             timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run a whole federation; returns the server's summary plus each client's exit code (``ok``: all 0)."""
    server, clients = start(config_path, overrides, config, run_dir)
    try:
        server_rc = server.wait(timeout_s)
        deadline = time.monotonic() + 60
        codes: list[int | None] = []
        for p in clients:
            try:
                codes.append(p.wait(max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        _stop([server, *clients])
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if server_rc == 0 and path.is_file() else {}
    summary.update({"server_exit_code": server_rc, "client_exit_codes": codes,
                    "ok": server_rc == 0 and all(c == 0 for c in codes)})
    atomic_write(path, json.dumps(summary, indent=1).encode())
    return summary
