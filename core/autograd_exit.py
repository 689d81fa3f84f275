"""Drains torch's autograd device threads before the interpreter finalizes, so a process that ran a backward on an
accelerator does not abort at exit ("terminate called without an active exception").

Why: torch's autograd engine runs an accelerator's backward nodes on one thread per device index. Every
``backward()`` stashes a Python object in the graph task's thread-local state (``torch.autograd.graph.
_engine_run_backward`` stashes a ``contextvars`` context), and the device thread can hold the graph task's last
reference after ``backward()`` returned (pytorch/pytorch#180701). Dropping it decrefs that object, which takes the
GIL; when that happens while Python finalizes, CPython ends the thread with ``pthread_exit``, whose forced unwind
through a ``noexcept`` destructor calls ``std::terminate`` (pytorch/pytorch#38228). Measured on simdev: 8 of 20
one-backward scripts aborted so. CUDA and NPU run the same engine code.

The drain: an ``atexit`` handler (run before finalization starts) runs a one-node backward rooted on the device
straight through the engine, without the stash. The device thread takes tasks in order, so once that backward
returns the thread has finished (and, with the GIL released by the waiting main thread, decref'd) every earlier
graph task; the drain's own graph task holds no Python object, so whoever drops it last needs no GIL.
"""

from __future__ import annotations

import atexit
import time

import torch

_registered: set[torch.device] = set()
#: the drain's tensors live until the interpreter clears this module: freeing them in the handler could leave the
#: device thread holding the last reference to a tensor whose Python object it must then free (the same abort)
_keep: list[torch.Tensor] = []


def drain_at_exit(device: torch.device) -> None:
    """Register (once per device) the exit drain of ``device``'s autograd thread; nothing for the host."""
    if device.type == "cpu" or device in _registered:
        return
    _registered.add(device)
    atexit.register(_drain, device)


def _drain(device: torch.device) -> None:
    try:
        leaf = torch.zeros((), device=device, requires_grad=True)
        out = leaf * 2.0
        seed = torch.ones_like(out)
        _keep.extend((leaf, out, seed))
        # the engine directly (not torch.autograd.backward): no Python object in the graph task's thread state
        _keep.extend(torch.autograd.Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
            (out,), (seed,), False, False, (leaf,), True, False))
        # the device thread drops the drain's own graph task (references to the drain's tensors) just after marking
        # it complete; a moment without the GIL lets it finish that before finalization (measured: without this
        # pause, 5 of 28 runs of a script that keeps the GIL (sys.setswitchinterval(30)) still aborted; with it 0 of 12)
        time.sleep(0.01)
    except Exception:  # noqa: BLE001 - best effort at exit: a device that cannot run it has nothing to drain
        pass
