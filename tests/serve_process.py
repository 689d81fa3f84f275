"""A real ``crosstrain serve`` process for tests: started, its URL read from the banner, terminated at the end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path


class ServeProcess:
    """A started server; :attr:`url` (``http://127.0.0.1:PORT``) waits for its one banner line on stdout, so work
    can overlap the start-up."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc, self.log = proc, log

    @cached_property
    def url(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert found, f"no listening line: {line!r}; stderr: {self.log.read_text()[-2000:]}"
        return found.group(0)


@contextmanager
def serve_process(args: list[str], log: Path, api_key: str | None = None) -> Iterator[ServeProcess]:
    """``crosstrain serve *args --port 0`` (``api_key``: its ``CROSSTRAIN_API_KEY``); its stderr goes to ``log`` (a
    file, not a pipe nobody reads: the server can never block on it)."""
    env = {**os.environ, **({"CROSSTRAIN_API_KEY": api_key} if api_key else {})}
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "crosstrain", "serve", *args, "--port", "0"],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        yield ServeProcess(proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
