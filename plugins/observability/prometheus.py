"""The Prometheus exporter: ``[observability] prometheus_port`` serves rank 0's latest metrics over HTTP.

Gauges (all prefixed ``crosstrain_``): ``step``, ``loss``, ``eval_loss``, ``tokens_per_second``, ``mfu``,
``peak_memory_bytes``, ``step_time_seconds``, ``seconds_since_last_step`` (an alert-ready stall gauge, computed
at scrape time, so it rises while the loop is stuck), ``last_checkpoint_step`` and
``last_checkpoint_age_seconds``; a ``events_total`` counter by event name. Served by prometheus-client's own
HTTP server thread, from a registry of this run only.

A metric gauge reads NaN until its metric was first written (``eval_loss`` until the first evaluation, not
0.0, which would read as a perfect loss) and then keeps its last value.
"""

from __future__ import annotations

import sys
import time
from typing import Any

#: metrics.jsonl key -> gauge name and help
GAUGES = {
    "loss": ("loss", "training loss of the last step"),
    "eval/loss": ("eval_loss", "loss on the held-out split at the last evaluation"),
    "tokens_per_s": ("tokens_per_second", "training throughput of the last step"),
    "mfu": ("mfu", "model FLOPs utilisation of the last step (0..1)"),
    "peak_memory_bytes": ("peak_memory_bytes", "peak device memory of rank 0"),
    "step_time_s": ("step_time_seconds", "wall time of the last step"),
}


def port_in_use_message(host: str, port: int, exc: OSError) -> str:
    import errno
    import socket

    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:  # the host is at fault, not the port
        return (f"crosstrain: error: [observability] prometheus_host {host!r} is not an address of this machine "
                f"({exc.strerror or exc}); set observability.prometheus_host to 127.0.0.1, 0.0.0.0 or one of its "
                "addresses")
    return (f"crosstrain: error: [observability] prometheus_port {port} on {host} is not free ({exc.strerror or exc}); "
            "pick another port (--set observability.prometheus_port=N) or 0 to turn the exporter off")


class PrometheusSink:
    """A metrics sink whose ``write`` updates gauges; the HTTP server starts in the constructor, so a port in use
    stops the run before its first step (one line on stderr, exit 2)."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self._last_step_time = time.time()
        self._last_checkpoint_time: float | None = None

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"crosstrain_{name}", doc, registry=self.registry)

        self.step = gauge("step", "optimizer steps completed")
        self.gauges = {key: gauge(name, doc) for key, (name, doc) in GAUGES.items()}
        for g in self.gauges.values():
            g.set(float("nan"))  # no value yet; a Gauge starts at 0.0
        gauge("seconds_since_last_step", "seconds since the last step completed (rises while the run is stalled)"
              ).set_function(lambda: time.time() - self._last_step_time)
        self.checkpoint_step = gauge("last_checkpoint_step", "step of the last checkpoint saved (-1: none yet)")
        self.checkpoint_step.set(-1)
        gauge("last_checkpoint_age_seconds", "seconds since the last checkpoint was saved (-1: none yet)"
              ).set_function(lambda: -1.0 if self._last_checkpoint_time is None
                             else time.time() - self._last_checkpoint_time)
        self.events = Counter("crosstrain_events", "events by name (resume, rollback, straggler, hang, ...)",
                              ["event"], registry=self.registry)
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            print(port_in_use_message(host, port, exc), file=sys.stderr, flush=True)
            raise SystemExit(2) from None  # not an Exception: a sink hook's failure would only be logged
        self.port = self.server.server_port

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._last_step_time = time.time()
        self.step.set(step)
        for key, g in self.gauges.items():
            value = metrics.get(key)
            if isinstance(value, (int, float)):
                g.set(value)

    def event(self, step: int, name: str, fields: dict[str, Any]) -> None:
        self.events.labels(event=name).inc()
        if name == "checkpoint":
            self._last_checkpoint_time = time.time()
            self.checkpoint_step.set(step)

    def close(self) -> None:
        server, self.server = getattr(self, "server", None), None  # type: ignore[assignment]
        if server is not None:
            server.shutdown()
            server.server_close()
