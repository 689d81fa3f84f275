"""Observability that needs optional packages: ``crosstrain report`` (matplotlib), the Prometheus exporter
(prometheus-client), both with ``pip install crosstrain[observability]``, and the MLflow sink
(``pip install crosstrain[mlflow]``); see docs/observability.md."""
