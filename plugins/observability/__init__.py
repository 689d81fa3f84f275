"""Observability that needs optional packages: ``crosstrain report`` (matplotlib), the Prometheus exporter
(prometheus-client). Install with ``pip install crosstrain[observability]``; see docs/observability.md."""
