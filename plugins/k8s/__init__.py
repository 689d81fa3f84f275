"""Kubernetes manifests for a run: ``crosstrain k8s`` (docs/cluster.md)."""
