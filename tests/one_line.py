"""One-line errors, the contract every bad-input test checks: a failed command prints no traceback and ends with
one error line; a refused call raises an error whose message is one line naming the problem."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from crosstrain.errors import ConfigError


def one_line_error(out: str, err: str, lines: int | None = None) -> list[str]:
    """Check a failed command's output and return stderr's non-blank lines: no traceback on either stream, the last
    line ``crosstrain: error: ...``, at most one warning line before it (exactly ``lines`` lines when given)."""
    got = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in out + err, err
    assert (len(got) == lines) if lines is not None else (1 <= len(got) <= 2), err
    assert got[-1].startswith("crosstrain: error: "), err
    return got


def raises_one_line(fn: Callable[[], Any], *words: str, error: type[Exception] = ConfigError) -> str:
    """Call ``fn``, which must raise ``error`` with a one-line message containing each of ``words``; the message."""
    with pytest.raises(error) as info:
        fn()
    text = str(info.value)
    assert "\n" not in text and text
    for word in words:
        assert word in text, f"{word!r} not in {text!r}"
    return text
