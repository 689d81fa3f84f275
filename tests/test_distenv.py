"""Reading the job layout from torchrun and SLURM variables."""

from __future__ import annotations

from crosstrain.distenv import DistEnv, first_slurm_host


def test_single_process_default():
    env = DistEnv.from_env({})
    assert env.world_size == 1 and not env.distributed


def test_torchrun_variables():
    env = DistEnv.from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 8, 1, 2)
    assert env.master_addr == "10.0.0.1" and env.master_port == 29400 and env.distributed


def test_slurm_variables():
    env = DistEnv.from_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                            "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[007-010],cpu1"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.master_addr == "gpu007" and env.master_port == 29500


def test_first_slurm_host_forms():
    assert first_slurm_host("node1") == "node1"
    assert first_slurm_host("node[3,5-9]") == "node3"
    assert first_slurm_host("a[01-02],b[1-4]") == "a01"
    assert first_slurm_host("") == ""
