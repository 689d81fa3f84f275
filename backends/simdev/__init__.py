"""simdev: a *software* accelerator for testing crosstrain on a device that is not the host.

Not hardware. A C++ extension (``csrc/``) registers torch's PrivateUse1 device under the name ``simdev``: device
memory the host cannot read directly (a tensor's data pointer is a no-access mapping, so any implicit host access
faults), a capacity per device (``SIMDEV_MEMORY_GB``) with CUDA-like counters and out-of-memory error, a device
guard, streams and events, a generator per device, ``SIMDEV_DEVICES`` devices per process, compute by a fallback to
the CPU kernels, and a c10d backend ``simgloo`` that stages collectives through gloo. See docs/backends.md.
"""
