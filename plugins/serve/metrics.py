"""``GET /metrics``: Prometheus counters, gauges and histograms of this server only (its own registry, as the
observability plugin's exporter keeps one per run). Names follow vLLM's (``num_requests_waiting``,
``e2e_request_latency_seconds``, ``time_to_first_token_seconds``, ``prompt_tokens_total``,
``generation_tokens_total``) under the ``crosstrain_serve_`` prefix."""

from __future__ import annotations

from typing import Any

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServeMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        p = "crosstrain_serve_"
        self.requests = Counter(f"{p}requests", "HTTP requests by endpoint and status code", ["endpoint", "status"],
                                registry=self.registry)
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "prompt tokens of finished requests",
                                     registry=self.registry)
        self.generation_tokens = Counter(f"{p}generation_tokens", "tokens generated", registry=self.registry)
        self.queue_depth = Gauge(f"{p}num_requests_waiting", "requests waiting for a batch slot",
                                 registry=self.registry)
        self.running = Gauge(f"{p}num_requests_running", "sequences decoding now", registry=self.registry)
        self.batch_size = Histogram(f"{p}batch_size", "sequences per decode step", buckets=BATCH_BUCKETS,
                                    registry=self.registry)
        self.latency = Histogram(f"{p}e2e_request_latency_seconds", "request latency, arrival to last token",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "arrival to first token", buckets=LATENCY_BUCKETS,
                              registry=self.registry)
        self.model_step = Gauge(f"{p}model_step", "training step of the checkpoint being served (-1: none)",
                                registry=self.registry)
        self.model_version = Gauge(f"{p}model_version", "serving version number (1 at start, +1 per swap)",
                                   registry=self.registry)
        self.swaps = Counter(f"{p}swaps", "hot swaps to a newer checkpoint", registry=self.registry)
        self.refused = Counter(f"{p}refused_versions", "checkpoints refused by verification or the gate",
                               registry=self.registry)

    def on_event(self, event: dict[str, Any]) -> None:
        """The model manager's events: a load or swap sets the step, a refusal counts."""
        if event["event"] in ("loaded", "swapped"):
            step = event.get("step")
            self.model_step.set(float(step) if step is not None else -1.0)
            self.model_version.set(event.get("version") or 0)
            if event["event"] == "swapped":
                self.swaps.inc()
        elif event["event"] == "refused":
            self.refused.inc()

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
