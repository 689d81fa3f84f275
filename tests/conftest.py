"""Session-wide test settings.

Triton decides between compiling and interpreting when its functions are decorated, including inside its own
package at import time, so ``TRITON_INTERPRET=1`` must be set before anything imports triton: the shared
Triton kernels are then checked on the CPU in this process (tests/test_triton_kernels.py).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402  (after the environment is set)


@pytest.fixture
def plugin():
    """Register in-process plugin objects for one test: ``plugin(obj, name)``; unregistered afterwards."""
    from crosstrain import pluginmanager

    names = []

    def register(obj, name):
        pluginmanager.register(obj, name=name)
        names.append(name)
        return obj

    yield register
    for name in names:
        pluginmanager.unregister(name)


@pytest.fixture(scope="session", autouse=True)
def _shared_ranks_stop():
    """Stop the 2 ranks that tests share (tests/shared_ranks.py) when the session ends."""
    yield
    import shared_ranks

    shared_ranks.close()
