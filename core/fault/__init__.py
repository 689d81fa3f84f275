"""Fault-tolerance helpers: elastic-restart-safe rendezvous and collectives that fail with a clear error."""
