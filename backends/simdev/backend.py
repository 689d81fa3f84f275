"""The simdev Backend: a software PrivateUse1 device for proving crosstrain runs off the host (not hardware).

Priority -10, below cpu, so ``backend = "auto"`` never picks it; select it by name (``CROSSTRAIN_BACKEND=simdev``).
No kernels of its own: the kernel registry resolves the references on device type ``simdev``, as it would for a new
vendor's chip before its fused kernels exist.
"""

from __future__ import annotations

from crosstrain.backend import Backend
from crosstrain.collective import Collective
from crosstrain.device import Device


class SimdevBackend(Backend):
    name = "simdev"
    priority = -10
    capabilities = frozenset({"bf16", "fp16", "streams", "pinned_memory"})
    install_hint = "dev"

    def make_device(self) -> Device:
        from crosstrain.backends.simdev.device import SimdevDevice

        return SimdevDevice()

    def collective(self) -> Collective:
        # the c10d backend "simgloo" is registered with the extension; load it before any process group exists
        from crosstrain.backends.simdev import runtime

        runtime.extension()
        return super().collective()

    def doctor_lines(self) -> list[tuple[str, str]]:
        from crosstrain.backends.simdev import build, device, runtime
        from crosstrain.diagnostics import env_lines

        state = "loaded" if runtime.loaded() else "compiled on first use into"
        return [("what", "a software device for testing (PrivateUse1 'simdev'), not hardware"),
                ("extension", f"{state} {build.cache_dir()}"),
                *env_lines(device.DEVICES_ENV, device.MEMORY_ENV, "CROSSTRAIN_SIMDEV_CACHE")]
