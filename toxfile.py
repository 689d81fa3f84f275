"""tox plugin of this project (tox 4 loads ``toxfile.py`` next to ``tox.ini`` by itself).

An env that says ``hardware = nvidia`` (or ``amd``, ``ascend``) is skipped, before anything is installed into it,
on a machine that shows no sign of that hardware: no device node and no driver tool on PATH. It then prints one
line saying so and why, installs nothing, runs nothing and exits 0. This keeps a CPU-only machine from downloading
a CUDA or ROCm build of torch (several GB) for a run that could only end in "no device". Where the hardware is
present the env installs and runs, and its conformance run fails (never skips) if the backend cannot use it.
``CROSSTRAIN_TOX_PROBE=off`` installs and runs anyway (a container that hides its device nodes, say).
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
from typing import Any

from tox.config.loader.memory import MemoryLoader
from tox.plugin import impl

#: hardware -> (device nodes, driver tools, what to say when none is found)
PROBES: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "nvidia": (("/dev/nvidiactl", "/dev/nvidia[0-9]*"), ("nvidia-smi",),
               "no NVIDIA GPU driver here (no /dev/nvidia* device node, no nvidia-smi)"),
    "amd": (("/dev/kfd",), ("rocm-smi", "amd-smi"), "no AMD ROCm driver here (no /dev/kfd, no rocm-smi or amd-smi)"),
    "ascend": (("/dev/davinci[0-9]*",), ("npu-smi",),
               "no Ascend NPU driver here (no /dev/davinci* device node, no npu-smi)"),
}

_absent: dict[str, str] = {}  # env name -> why its hardware is absent


def missing_hardware(kind: str) -> str | None:
    """Why this machine cannot have ``kind`` hardware, or None when a device node or a driver tool is there."""
    nodes, tools, reason = PROBES[kind]
    if any(glob.glob(pattern) for pattern in nodes) or any(shutil.which(tool) for tool in tools):
        return None
    return reason


@impl
def tox_add_env_config(env_conf: Any, state: Any) -> None:
    env_conf.add_config(keys=["hardware"], of_type=str, default="",
                        desc="nvidia, amd or ascend: skip this env before installing where that hardware is absent")
    kind = env_conf["hardware"]
    if not kind or os.environ.get("CROSSTRAIN_TOX_PROBE", "").lower() == "off":
        return
    if kind not in PROBES:
        raise ValueError(f"[testenv:{env_conf.name}] hardware = {kind!r}; use one of {', '.join(PROBES)}")
    reason = missing_hardware(kind)
    if reason is None:
        return
    # Not tox's own Skip: tox 4 exits 1 when every env it ran was skipped, and a machine without the hardware is
    # not a failure. So the env keeps its name and loses what it would install and run.
    _absent[env_conf.name] = reason
    env_conf.loaders.insert(0, MemoryLoader(skip_install=True, deps="", extras=[], commands_pre=[], commands=[],
                                            commands_post=[]))


@impl
def tox_before_run_commands(tox_env: Any) -> None:
    reason = _absent.get(tox_env.name)
    if reason is not None:
        logging.warning("skipped: %s; nothing was installed or tested (CROSSTRAIN_TOX_PROBE=off runs it anyway)",
                        reason)
