"""Test utilities shipped with crosstrain (multi-process runner, op inputs, the conformance suite)."""
