"""``torch.simdev``: the device module of the simdev software device, shaped like ``torch.cuda`` / ``torch.npu``.

Registered by :func:`crosstrain.backends.simdev.runtime.extension` through ``torch._register_device_module``; every
function takes ``device`` as an index, a ``torch.device`` or None (the current device), as torch.cuda does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


def _ext() -> Any:
    from crosstrain.backends.simdev.runtime import extension

    return extension()


def _index(device: Any = None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return current_device() if device.index is None else device.index


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    _ext()


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return int(_ext().device_count())


def current_device() -> int:
    return int(_ext().current_device())


def set_device(device: Any) -> None:
    _ext().set_device(_index(device))


class device:  # noqa: N801 - named like torch.cuda.device
    """Context manager that makes ``index`` the current simdev device."""

    def __init__(self, index: Any) -> None:
        self.index = _index(index)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = current_device()
        set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        set_device(self.prev)


def synchronize(device: Any = None) -> None:
    """Work on simdev runs synchronously: nothing is ever pending."""


@dataclass(frozen=True)
class _Properties:
    name: str
    total_memory: int


def get_device_name(device: Any = None) -> str:
    return "simdev (software device, not hardware)"


def get_device_properties(device: Any = None) -> _Properties:
    return _Properties(get_device_name(device), memory_stats(device)["capacity_bytes"])


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# --- memory ---
def memory_stats(device: Any = None) -> dict[str, int]:
    return dict(_ext().memory_stats(_index(device)))


def memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["allocated_bytes"]


def memory_reserved(device: Any = None) -> int:
    return memory_stats(device)["reserved_bytes"]


def max_memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["peak_allocated_bytes"]


def max_memory_reserved(device: Any = None) -> int:
    return memory_stats(device)["peak_reserved_bytes"]


def reset_peak_memory_stats(device: Any = None) -> None:
    _ext().reset_peak_memory_stats(_index(device))


def empty_cache() -> None:
    _ext().empty_cache()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    stats = memory_stats(device)
    return stats["capacity_bytes"] - stats["reserved_bytes"], stats["capacity_bytes"]


# --- RNG: one generator per device, with the CPU generator's algorithm (same seed, same draws) ---
def default_generator(device: Any = None) -> torch.Generator:
    return _ext().default_generator(_index(device))


def __getattr__(name: str) -> Any:
    if name == "default_generators":  # like torch.cuda.default_generators, built on first access
        return tuple(default_generator(i) for i in range(device_count()))
    raise AttributeError(name)


def manual_seed(seed: int) -> None:
    default_generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        default_generator(i).manual_seed(int(seed))


def seed() -> None:
    default_generator().seed()


def seed_all() -> None:
    for i in range(device_count()):
        default_generator(i).seed()


def initial_seed() -> int:
    return int(default_generator().initial_seed())


def get_rng_state(device: Any = "simdev") -> torch.Tensor:
    return default_generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "simdev") -> None:
    default_generator(device).set_state(new_state.clone())


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


# --- streams and events (torch.Stream / torch.Event on this device; work is synchronous) ---
def Stream(device: Any = None, priority: int = 0) -> torch.Stream:  # noqa: N802 - a constructor, like torch.cuda
    return torch.Stream(device=torch.device("simdev", _index(device)), priority=priority)


def Event(enable_timing: bool = False, **kwargs: Any) -> torch.Event:  # noqa: N802
    return torch.Event(device=torch.device("simdev", current_device()), enable_timing=enable_timing)


def current_stream(device: Any = None) -> torch.Stream:
    return torch.accelerator.current_stream(torch.device("simdev", _index(device)))


def default_stream(device: Any = None) -> torch.Stream:
    return current_stream(device)


def stream(s: torch.Stream) -> torch.Stream:
    """Context manager that makes ``s`` the current stream (a ``torch.Stream`` is one)."""
    return s
