"""Federated learning with secure aggregation (SecAgg+ over gRPC with TLS) and differential privacy."""
