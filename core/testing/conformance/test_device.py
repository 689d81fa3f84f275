"""Device interface conformance."""

from __future__ import annotations

import pytest
import torch

from crosstrain.device import CAPABILITIES, MemoryStats


def test_identity(backend, device):
    assert backend.name
    assert set(backend.capabilities) <= set(CAPABILITIES)
    assert device.device_count() >= 1
    assert device.dist_backend
    assert device.device_for_local_rank(0).type == device.type
    assert device.current_device().type == device.type


def test_tensor_on_device_and_synchronize(device):
    x = torch.arange(16, dtype=torch.float32, device=device.current_device())
    y = (x * 2).sum()
    device.synchronize()
    assert y.item() == 240.0


def test_rng_round_trip(device):
    dev = device.current_device()
    device.manual_seed(1234)
    state = device.get_rng_state()
    a = torch.rand(64, device=dev)
    device.set_rng_state(state)
    b = torch.rand(64, device=dev)
    assert torch.equal(a, b)
    c = torch.rand(64, device=dev)
    assert not torch.equal(a, c)


def test_memory_stats_track_allocation(device):
    dev = device.current_device()
    device.reset_peak_memory_stats()
    before = device.memory_stats()
    assert isinstance(before, MemoryStats)
    assert before.peak >= before.allocated >= 0
    block = torch.ones(32 * 1024 * 1024, dtype=torch.uint8, device=dev)  # 32 MiB, touched
    device.synchronize()
    after = device.memory_stats()
    assert after.peak >= before.allocated + 16 * 1024 * 1024
    assert after.total == 0 or after.total >= after.peak
    del block
    device.empty_cache()


def test_dtypes_and_autocast(device):
    dtypes = device.supported_dtypes()
    assert torch.float32 in dtypes
    ac = device.autocast_dtype()
    assert ac in dtypes
    a = torch.randn(8, 8, device=device.current_device())
    with torch.autocast(device_type=device.type, dtype=ac):
        out = a @ a
    assert out.dtype == ac


def test_peak_flops_positive(device):
    assert device.peak_flops(torch.float32) > 0


def test_streams_and_events_when_declared(backend, device):
    if not backend.has("streams"):
        pytest.skip(f"backend {backend.name!r} declares no streams")
    stream = device.stream()
    start, end = device.event(enable_timing=True), device.event(enable_timing=True)
    assert stream is not None and start is not None and end is not None


def test_pin_memory(backend, device):
    t = torch.ones(1024)
    pinned = device.pin_memory(t)
    assert torch.equal(pinned, t)
    if backend.has("pinned_memory"):
        assert pinned.is_pinned()


def test_channels_last_convolution(device):
    """``prefers_channels_last`` is a bool; a device that prefers it (the image recipes then convert on ``"auto"``)
    gives a convolution of channels_last tensors the NCHW result (a wrong layout errs by O(1), TF32 by ~1e-3)."""
    assert isinstance(device.prefers_channels_last, bool)
    if not device.prefers_channels_last:
        pytest.skip(f"{type(device).__name__}.prefers_channels_last is False: the recipes keep NCHW here")
    dev = device.current_device()
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 8, 10, 10, generator=gen), torch.randn(16, 8, 3, 3, generator=gen)
    ref = torch.nn.functional.conv2d(x, w, padding=1)
    cl = torch.channels_last
    out = torch.nn.functional.conv2d(x.to(dev).contiguous(memory_format=cl), w.to(dev).contiguous(memory_format=cl),
                                     padding=1)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-2, atol=5e-2)
