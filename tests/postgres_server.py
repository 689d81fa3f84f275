"""A real PostgreSQL server for the tests: Debian's ``postgresql`` package (``.ci/run`` installs it), a cluster made
by ``initdb`` in a temporary folder, started once per test session and stopped at its end.

It is set up as a deployment would be: the server listens on 127.0.0.1 (a free port) and on a unix socket in the
temporary folder; over TCP every client authenticates with a password (``scram-sha-256``), on the socket only the
operating-system user that owns the cluster, by ``peer``, who creates the ``crosstrain`` role and its ``tune``
database. PostgreSQL refuses to run as root, so as root the cluster is owned by the ``postgres`` user the package
creates (``runuser``).
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Server:
    """A database server a fixture started, reached as user ``crosstrain`` over TCP (tests/mysql_server.py too)."""
    host: str
    port: int
    password: str
    scheme: str = "postgresql"

    def url(self, database: str = "tune") -> str:
        return f"{self.scheme}://crosstrain:{self.password}@{self.host}:{self.port}/{database}"


def binaries() -> Path | None:
    """The newest installed server's bin folder (``/usr/lib/postgresql/<version>/bin``), None without one."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name))
    return Path(found[-1]).parent if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def postgres() -> Iterator[Server]:
    bin_dir = binaries()
    if bin_dir is None:
        pytest.skip("the PostgreSQL server is not installed (.ci/run installs it: apt-get install -y postgresql)")
    as_user: list[str] = []
    owner = None
    if os.geteuid() == 0:  # initdb and postgres refuse root
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to own the test cluster")
        as_user = ["runuser", "-u", "postgres", "--"]
    root = Path(tempfile.mkdtemp(prefix="crosstrain-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    password = secrets.token_hex(16)
    (root / "pw").write_text(password + "\n")  # initdb's --pwfile: the superuser gets a password too
    if owner is not None:
        for path in (root, sock, root / "pw"):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    superuser = owner.pw_name if owner is not None else pwd.getpwuid(os.geteuid()).pw_name
    port = free_port()

    def run(*argv: str) -> None:
        subprocess.run([*as_user, *argv], check=True, capture_output=True, timeout=120)

    run(str(bin_dir / "initdb"), "-D", str(data), "-U", superuser, "--auth-local=peer",
        "--auth-host=scram-sha-256", f"--pwfile={root / 'pw'}", "--no-sync", "-E", "UTF8")
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {sock} -c fsync=off"
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-o", options, "-w", "-t", "60",
        "start")
    try:
        psql = [str(bin_dir / "psql"), "-h", str(sock), "-p", str(port), "-U", superuser, "-d", "postgres",
                "-v", "ON_ERROR_STOP=1", "-q"]
        run(*psql, "-c", f"CREATE ROLE crosstrain LOGIN PASSWORD '{password}'")
        run(*psql, "-c", "CREATE DATABASE tune OWNER crosstrain")
        yield Server("127.0.0.1", port, password)
    finally:
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)
