"""``quiet_redistribute`` drops DTensor's redistribution warnings and keeps its errors, without touching levels."""

from __future__ import annotations

import logging

from crosstrain.parallel.state import quiet_redistribute


def test_warnings_are_dropped_errors_kept_and_the_logger_left_as_it_was(caplog) -> None:
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level, filters = log.level, list(log.filters)
    with caplog.at_level(logging.DEBUG, logger=log.name):
        with quiet_redistribute(), quiet_redistribute():  # nested: the inner exit keeps the outer's filter
            log.warning("two collectives")
            log.error("a real problem")
        log.warning("after")
    assert [r.getMessage() for r in caplog.records] == ["a real problem", "after"]
    assert log.filters == filters
    assert log.level == level
