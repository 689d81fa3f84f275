"""Start the server: bind the port first (a port in use is a one-line error before anything loads), load and gate
the first version, then run uvicorn on that socket, in the foreground (the CLI) or on a thread (tests, benchmarks).
SIGTERM/SIGINT drain the replies in flight (shutdown.py), then the temp dir goes and the process exits 0.
"""

from __future__ import annotations

import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from crosstrain.errors import ConfigError
from crosstrain.plugins.serve.config import ServeOptions


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: any free port), or a one-line ConfigError naming the fix."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family = infos[0][0]
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (accepted ones inherit
        # it); without it every reply's last segment waits on the client's delayed-ACK timer (~40 ms on Linux)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    except OSError as exc:
        raise ConfigError(f"--host {host!r} is not an address of this machine ({exc}); use 127.0.0.1 or "
                          "0.0.0.0") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); the port is in use or not "
                          "allowed: pick another with --port (0 = any free port)") from None
    sock.set_inheritable(True)
    return sock


class Server:
    """One running ``crosstrain serve``: the bound socket, the model manager, the scheduler and the ASGI app."""

    def __init__(self, options: ServeOptions) -> None:
        import torch

        from crosstrain.kernels import registry as kernel_registry
        from crosstrain.plugins.serve.app import Served, create_app
        from crosstrain.plugins.serve.auth import require_api_key
        from crosstrain.plugins.serve.manager import ModelManager
        from crosstrain.plugins.serve.metrics import ServeMetrics
        from crosstrain.plugins.serve.scheduler import Scheduler

        self.options = options
        self.sock = bind(options.host, options.port)
        self._threads_before = torch.get_num_threads()  # restored on close (an in-process server shares torch)
        if options.threads:
            torch.set_num_threads(options.threads)
        # the reference kernels, as `crosstrain generate` and the export parity check use: same tokens as they give
        self._reference = kernel_registry.use_reference()
        self._reference.__enter__()
        self._tmp = tempfile.TemporaryDirectory(prefix="crosstrain-serve-")
        try:
            self.metrics = ServeMetrics()
            self.manager = ModelManager(options, Path(self._tmp.name), on_event=self.metrics.on_event)
            self.scheduler = Scheduler(self.manager, self.metrics, options.max_batch, options.max_wait_ms)
        except BaseException:
            self.sock.close()
            self._tmp.cleanup()
            self._reference.__exit__(None, None, None)
            raise
        self.name = options.model_name or _default_name(options.source)
        self.served = Served(self.name, self.manager, self.scheduler, self.metrics)
        self.app = create_app(self.served)
        require_api_key(self.app, options.api_key)
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    @property
    def url(self) -> str:
        host = self.options.host if self.options.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def _uvicorn_server(self, on_started: Any = None) -> Any:
        import uvicorn

        from crosstrain.plugins.serve.shutdown import FLUSH_S, GracefulServer

        grace = self.options.shutdown_grace_s
        # uvicorn cancels what is left only after the grace period has ended every reply and FLUSH_S more has passed
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=grace + FLUSH_S)
        return GracefulServer(config, self.served.inflight, grace, on_started)

    def banner(self) -> str:
        v = self.manager.current
        watching = f", watching {self.manager.run_dir}" if self.manager.run_dir else ""
        return (f"crosstrain serve: listening on {self.url}/v1 (model {self.name!r}, step {v.step}, engine "
                f"{v.engine}, max batch {self.options.max_batch}{watching})")

    def serve_forever(self) -> str:
        """Run in the foreground until SIGINT/SIGTERM, drain, clean up; returns the one line saying how it stopped.
        The banner is printed once uvicorn accepts and its signal handlers are in place."""
        try:
            self.scheduler.start()
            self.manager.start()
            self._uvicorn = self._uvicorn_server(lambda: print(self.banner(), flush=True))
            self._uvicorn.run(sockets=[self.sock])
            return str(self._uvicorn.summary())
        finally:
            self.close()

    def start(self) -> Server:
        """Serve on a background thread; returns once the server accepts connections."""
        self.scheduler.start()
        self.manager.start()
        self._uvicorn = self._uvicorn_server()
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self.sock]},
                                        name="crosstrain-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.close()

    def close(self) -> None:
        self.manager.stop()
        self.scheduler.stop()
        self.sock.close()
        self._tmp.cleanup()
        self._reference.__exit__(None, None, None)
        import torch

        torch.set_num_threads(self._threads_before)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _default_name(source: str) -> str:
    """The run dir's name for a run (or one of its checkpoints), else the file or folder name."""
    p = Path(source).resolve()
    if p.parent.name == "checkpoints":
        p = p.parent.parent
    elif p.name == "checkpoints":
        p = p.parent
    return p.stem if p.suffix in (".onnx", ".safetensors") else p.name


def main(options: ServeOptions) -> int:
    # until uvicorn takes the signals over, SIGTERM interrupts like SIGINT, so loading a model is cut short with its
    # temp dir removed (Server.__init__ and serve_forever clean up on any exception) rather than killed mid-way
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        line = Server(options).serve_forever()
    except KeyboardInterrupt:
        line = "crosstrain serve: stopped before it was serving"
    print(line, file=sys.stderr)
    return 0
