"""The backend conformance suite: ``pytest --pyargs crosstrain.testing.conformance --backend NAME``.

It checks one backend through the core interfaces only: device ops, RNG round trip, memory stats, every collective
on two real processes, every registered kernel against its reference (forward and backward), and a checkpoint
round trip. A backend that is unavailable here is skipped with one line that says why, never passed.
"""
