"""Session-wide test settings.

Triton decides between compiling and interpreting when its functions are decorated, including inside its own
package at import time, so ``TRITON_INTERPRET=1`` must be set before anything imports triton: the shared
Triton kernels are then checked on the CPU in this process (tests/test_triton_kernels.py).
"""

import contextlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402  (after the environment is set)


@contextlib.contextmanager
def _registering():
    from crosstrain import pluginmanager

    names = []

    def register(obj, name):
        pluginmanager.register(obj, name=name)
        names.append(name)
        return obj

    try:
        yield register
    finally:
        for name in names:
            pluginmanager.unregister(name)


@pytest.fixture
def plugin():
    """Register in-process plugin objects for one test: ``plugin(obj, name)``; unregistered afterwards."""
    with _registering() as register:
        yield register


@pytest.fixture
def backend_plugin():
    """Bring backends in for one test: ``backend_plugin(name, *backends)`` registers a plugin whose
    ``crosstrain_register_backends`` returns them (``backend_plugin(name, obj)`` with any other object registers
    that object); afterwards the plugins are unregistered and the CPU backend is active again."""
    from crosstrain import hookimpl, registry
    from crosstrain.backend import Backend

    class Backends:
        def __init__(self, backends):
            self.backends = list(backends)

        @hookimpl
        def crosstrain_register_backends(self):
            return self.backends

    def add(name, *backends):
        if len(backends) == 1 and not isinstance(backends[0], Backend):
            return register(backends[0], name)
        return register(Backends(backends), name)

    try:
        with _registering() as register:
            yield add
    finally:
        registry.set_active_backend("cpu")


@pytest.fixture(scope="session", autouse=True)
def _shared_ranks_stop():
    """Stop the 2 ranks that tests share (tests/shared_ranks.py) when the session ends."""
    yield
    import shared_ranks

    shared_ranks.close()
