"""Bad inputs to `crosstrain fl`: each is refused in one line naming the problem and the fix, exits non-zero and
writes no run dir. A client's own certificate (another CA's, expired, not valid yet, not its key's), `simulate
--clients 0`, a port beyond 65535, and a second server on a port another server listens on."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from in_process import crosstrain_main

from crosstrain.plugins.fl import certs
from crosstrain.plugins.fl.coordinator import Coordinator
from crosstrain.plugins.fl.grpc_transport import _SERVER_OPTIONS, serve

NOW = datetime.datetime.now(datetime.timezone.utc)
DAY = datetime.timedelta(days=1)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    base = tmp_path_factory.mktemp("pki")
    return certs.generate(base / "run", 1), certs.generate(base / "other", 1)


def one_line_error(argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.setenv("GRPC_VERBOSITY", "NONE")  # what the command sets, kept out of this process's later tests
    code = crosstrain_main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    return code, lines[0]


def client_certs(tmp_path: Path, pki: Path, valid: tuple[datetime.datetime, datetime.datetime] | None = None,
                 key_from: Path | None = None) -> Path:
    """A copy of ``pki`` whose client-0 certificate the run's CA reissued with ``valid`` dates, or whose key is
    another client's (``key_from``)."""
    out = tmp_path / "certs"
    shutil.copytree(pki, out)
    if valid is not None:
        ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = certs._issue("client-0", key, certs._name("crosstrain fl CA"), ca_key, valid=valid)  # type: ignore[arg-type]
        certs._write(out, "client-0", cert, key)
    if key_from is not None:
        shutil.copy(key_from / "client-0.key", out / "client-0.key")
    return out


def client_argv(folder: Path, run_dir: Path) -> list[str]:
    return ["fl", "client", "--set", f"fl.certs={folder}", "--set", "fl.address=127.0.0.1:1", "--id", "0",
            "--run-dir", str(run_dir)]


@pytest.mark.parametrize("case, expect", [
    ("other_ca", "is not signed by"),
    ("expired", "expired on"),
    ("not_yet_valid", "is not valid yet"),
    ("wrong_key", "does not match its key"),
])
def test_client_certificate_checked_before_connecting(pki, tmp_path, capsys, monkeypatch, case, expect):
    ours, other = pki
    if case == "other_ca":  # another CA's client-0 next to this run's ca.crt
        folder = tmp_path / "certs"
        shutil.copytree(ours, folder)
        for suffix in (".crt", ".key"):
            shutil.copy(other / f"client-0{suffix}", folder / f"client-0{suffix}")
    elif case == "expired":
        folder = client_certs(tmp_path, ours, (NOW - 30 * DAY, NOW - DAY))
    elif case == "not_yet_valid":
        folder = client_certs(tmp_path, ours, (NOW + DAY, NOW + 30 * DAY))
    else:
        folder = client_certs(tmp_path, ours, key_from=other)
    code, line = one_line_error(client_argv(folder, tmp_path / "run"), capsys, monkeypatch)
    assert code == 2 and expect in line and "client-0.crt" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, expect", [
    (["fl", "simulate", "--clients", "0"], "--clients 0: a federation needs at least one client"),
    (["fl", "simulate", "--clients", "-2"], "--clients -2"),
    (["fl", "server", "--set", "fl.address=127.0.0.1:99999"], "port 99999 is beyond 65535"),
    (["fl", "server", "--set", "fl.secure=true", "--set", "fl.aggregation=median"], "SecAgg+ hides"),
    (["fl", "server", "--set", "fl.secure=false", "--set", "fl.clients=3", "--set", "fl.aggregation=trimmed_mean"],
     "trims none of fl.clients=3"),
])
def test_config_errors(tmp_path, capsys, monkeypatch, argv, expect):
    code, line = one_line_error([*argv, "--run-dir", str(tmp_path / "run")], capsys, monkeypatch)
    assert code == 2 and expect in line, line
    assert not (tmp_path / "run").exists()


def test_second_server_on_a_busy_port(pki, tmp_path):
    """The port another server listens on: gRPC itself no longer binds it (SO_REUSEPORT off), and `crosstrain fl
    server` says so in one line (no gRPC log before it), exits non-zero and writes nothing."""
    ours, _ = pki
    first, port = serve(Coordinator(), certs.load(ours, "server"), "127.0.0.1:0", 2)
    try:
        second = grpc.server(None, options=_SERVER_OPTIONS)  # type: ignore[arg-type]
        try:
            bound = second.add_insecure_port(f"127.0.0.1:{port}")
        except RuntimeError:  # newer grpc raises where older ones return 0
            bound = 0
        assert bound == 0
        env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
        run = subprocess.run([sys.executable, "-m", "crosstrain", "fl", "server", "--set", f"fl.certs={ours}",
                              "--set", f"fl.address=127.0.0.1:{port}", "--run-dir", str(tmp_path / "run")],
                             capture_output=True, text=True, env=env, timeout=120)
    finally:
        first.stop(grace=None)
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0 and len(lines) == 1 and run.stdout == "", run
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("address, expect", [
    ("192.0.2.7:5000", "Cannot assign requested address; fl.address must name this machine"),  # TEST-NET-1
    ("no-such-host.invalid:5000", "cannot resolve host 'no-such-host.invalid'"),
])
def test_server_address_not_of_this_machine(pki, tmp_path, capsys, monkeypatch, address, expect):
    ours, _ = pki
    code, line = one_line_error(["fl", "server", "--set", f"fl.certs={ours}", "--set", f"fl.address={address}",
                                 "--run-dir", str(tmp_path / "run")], capsys, monkeypatch)
    assert code != 0 and expect in line, line
    assert not (tmp_path / "run").exists()
