"""Where this process sits in a job: rank, world size and rendezvous, read from torchrun or SLURM."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    """Rank layout of the current process. ``world_size == 1`` with no master means single-process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistEnv:
        """Read torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...), else SLURM's, else single-process."""
        env = os.environ if env is None else env
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", "0")),
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                master_addr=env.get("MASTER_ADDR"),
                master_port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None,
            )
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
            return cls(
                rank=int(env["SLURM_PROCID"]),
                world_size=int(env["SLURM_NTASKS"]),
                local_rank=int(env.get("SLURM_LOCALID", "0")),
                local_world_size=int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]),
                master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist) or None,
                master_port=int(env.get("MASTER_PORT", "29500")),
            )
        return cls()

    def export(self) -> None:
        """Write the torchrun variables that ``init_process_group(init_method="env://")`` reads."""
        os.environ["RANK"] = str(self.rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        os.environ["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        if self.master_addr:
            os.environ["MASTER_ADDR"] = self.master_addr
        if self.master_port:
            os.environ["MASTER_PORT"] = str(self.master_port)


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as ``node[001-004,007],gpu5`` -> ``node001``."""
    nodelist = nodelist.strip()
    if not nodelist:
        return ""
    first = nodelist
    depth = 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            first = nodelist[:i]
            break
    if "[" not in first:
        return first
    prefix, rest = first.split("[", 1)
    token = rest.rstrip("]").split(",")[0].split("-")[0]
    return prefix + token
