"""A real MariaDB server (MySQL's protocol) for the tests, where Debian's ``mariadb-server`` package is installed
(``.ci/run`` does not install it: the tests that use it skip there): ``mariadb-install-db`` into a temporary folder,
started once per test session, stopped at its end.

As a deployment: the server listens on 127.0.0.1 (a free port), where the ``crosstrain`` user authenticates with a
password; on the unix socket in the temporary folder only the operating-system user running the tests is let in
(``unix_socket`` authentication), who creates that user and its ``tune`` database. As root the server drops to the
``mysql`` user the package creates.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from postgres_server import Server, free_port


@pytest.fixture(scope="session")
def mariadb() -> Iterator[Server]:
    server, install = shutil.which("mariadbd", path="/usr/sbin:/usr/bin"), shutil.which("mariadb-install-db")
    if server is None or install is None:
        pytest.skip("the MariaDB server is not installed (apt-get install -y mariadb-server; .ci/run does not)")
    user = "mysql" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    me = pwd.getpwuid(os.geteuid()).pw_name
    root = Path(tempfile.mkdtemp(prefix="crosstrain-mariadb-"))
    data, sock = root / "data", root / "mysqld.sock"
    if os.geteuid() == 0:
        owner = pwd.getpwnam(user)
        os.chown(root, owner.pw_uid, owner.pw_gid)
    common = ["--no-defaults", f"--datadir={data}", f"--user={user}"]
    subprocess.run([install, *common, "--auth-root-authentication-method=socket", f"--auth-root-socket-user={me}",
                    "--skip-test-db"], check=True, capture_output=True, timeout=300)
    port = free_port()
    proc = subprocess.Popen([server, *common, f"--socket={sock}", f"--port={port}", "--bind-address=127.0.0.1",
                             f"--pid-file={root / 'mysqld.pid'}", f"--log-error={root / 'error.log'}",
                             "--skip-log-bin"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = [shutil.which("mariadb") or "mariadb", "--no-defaults", f"--socket={sock}", "-u", me]
        deadline = time.time() + 120
        while subprocess.run([*client, "-e", "SELECT 1"], capture_output=True).returncode != 0:
            assert proc.poll() is None and time.time() < deadline, (root / "error.log").read_text()
            time.sleep(0.2)
        password = secrets.token_hex(16)
        subprocess.run([*client, "-e", f"CREATE USER 'crosstrain'@'127.0.0.1' IDENTIFIED BY '{password}'; "
                        "CREATE DATABASE tune; GRANT ALL ON tune.* TO 'crosstrain'@'127.0.0.1';"],
                       check=True, capture_output=True, timeout=60)
        yield Server("127.0.0.1", port, password, scheme="mysql+pymysql")
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        shutil.rmtree(root, ignore_errors=True)
