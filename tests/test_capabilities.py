"""Declared capabilities are consulted: a precision the backend does not declare is a one-line config error."""

from __future__ import annotations

import pytest

from crosstrain import registry
from crosstrain.backend import Backend
from crosstrain.backends.cpu.device import CpuDevice
from crosstrain.config.loader import load_config
from crosstrain.engine.capabilities import check_capabilities
from crosstrain.errors import ConfigError


class Bf16OnlyBackend(Backend):
    """A real backend (a CPU device) that declares bf16 but not fp16."""

    name = "bf16only"
    priority = -10
    capabilities = frozenset({"bf16"})

    def make_device(self) -> CpuDevice:
        return CpuDevice()


@pytest.fixture
def bf16only(backend_plugin):
    backend_plugin("bf16only-plugin", Bf16OnlyBackend())
    return registry.set_active_backend("bf16only")


def test_undeclared_precision_is_a_one_line_config_error(bf16only):
    with pytest.raises(ConfigError) as info:
        check_capabilities(bf16only, load_config(None, ["precision.dtype=fp16"]))
    message = str(info.value)
    assert "\n" not in message
    assert "precision.dtype='fp16'" in message and "'bf16only'" in message
    assert "use precision.dtype one of 'fp32', 'bf16'" in message


def test_declared_precisions_pass(bf16only):
    for dtype in ("fp32", "bf16"):
        check_capabilities(bf16only, load_config(None, [f"precision.dtype={dtype}"]))
    cpu = registry.get_backend("cpu")
    for dtype in ("fp32", "bf16", "fp16"):
        check_capabilities(cpu, load_config(None, [f"precision.dtype={dtype}"]))
