"""Where ``crosstrain generate`` and ``crosstrain serve`` compute: the process's backend, selected as
``crosstrain train`` selects it (``CROSSTRAIN_BACKEND``, else ``auto`` by priority), and its first device.

One process serves on one device (rank 0's), so a GPU machine generates on the GPU and the cpu backend on the host
as before. The onnxruntime engine ignores this: it always runs on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    """The selected backend's name and the device the model, the KV cache and the sampling generators live on."""

    backend: str
    device: torch.device

    def generator(self, seed: int | None) -> torch.Generator:
        """A generator on :attr:`device` (sampling draws where the logits are), seeded, or from fresh entropy."""
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        return generator


def inference_placement() -> Placement:
    """The active backend and its device for local rank 0, made the current device."""
    from crosstrain import registry

    backend = registry.active_backend()
    api = backend.device()
    device = api.device_for_local_rank(0)
    api.set_device(device)
    return Placement(backend.name, device)


#: the onnxruntime engine's: it runs on the host whatever the backend, and samples with a CPU generator
HOST = Placement("host", torch.device("cpu"))
