"""``python -m crosstrain.testing.conformance``: an unavailable backend ends with one line, never a pass."""

from __future__ import annotations

import pytest

from crosstrain.backend import Backend
from crosstrain.device import Availability
from crosstrain.testing.conformance.__main__ import main


class AbsentDevice:
    type = "cpu"

    def availability(self) -> Availability:
        return Availability(False, "no absentbox card in this machine")


class AbsentBackend(Backend):
    name = "absentbox"

    def make_device(self) -> AbsentDevice:  # type: ignore[override]
        return AbsentDevice()


@pytest.fixture
def absent(backend_plugin):
    backend_plugin("absent-plugin", AbsentBackend())


def test_unavailable_backend_is_one_skip_line_and_exit_0(absent, capsys):
    assert main(["--backend", "absentbox", "-q"]) == 0
    out = capsys.readouterr().out
    assert out == "conformance absentbox: skipped, backend unavailable here: no absentbox card in this machine\n"


def test_require_turns_the_skip_into_a_failure(absent, capsys):
    assert main(["--backend", "absentbox", "--require"]) == 1
    assert capsys.readouterr().out.startswith("conformance absentbox: failed, backend unavailable here: ")


def test_unknown_backend_is_an_error(capsys):
    assert main(["--backend", "warpdrive"]) == 2
    assert "unknown backend 'warpdrive'" in capsys.readouterr().err
