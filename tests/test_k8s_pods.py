"""The closest to a cluster this machine allows: the command lines of a generated Indexed Job's 2 pods run as local
processes, each with its pod's environment (JOB_COMPLETION_INDEX, HOSTNAME, the container's env), the ConfigMap
and the claim as local folders at the mount points' places, and the headless Service's name for pod 0 replaced by
127.0.0.1 (with a free port: this machine is shared). They rendezvous over c10d, train, and end with the weights of
`crosstrain train --nproc 2` on the same config (params_sha256). No Kubernetes cluster is involved."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml
from in_process import crosstrain_main

from crosstrain.collective import free_port
from crosstrain.plugins.k8s.manifests import CONFIG_FILE, RDZV_PORT, RUNS_DIR

TINY = ["train.steps=4", "train.batch_size=4", "train.seq_len=32", "eval.every=0", "logging.progress=none",
        "logging.tensorboard=false", "schedule.warmup_steps=1", "model.n_layers=1"]


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def test_the_pods_command_lines_train_like_nproc_2(tmp_path) -> None:
    out = tmp_path / "manifests"
    argv = ["k8s", "--nodes", "2", "--nproc-per-node", "1", "--backend", "cpu", "--name", "tiny", "--out", str(out)]
    assert crosstrain_main([*argv, *[a for s in TINY for a in ("--set", s)]]) == 0
    job = yaml.safe_load((out / "job.yaml").read_text())
    service = yaml.safe_load((out / "service.yaml").read_text())
    config = tmp_path / "configmap" / "config.toml"  # the ConfigMap's volume
    config.parent.mkdir()
    config.write_text(yaml.safe_load((out / "configmap.yaml").read_text())["data"]["config.toml"])
    claim = tmp_path / "claim"  # the PersistentVolumeClaim's volume, shared by both pods
    container = job["spec"]["template"]["spec"]["containers"][0]
    pod0 = f"{job['metadata']['name']}-0.{service['metadata']['name']}:{RDZV_PORT}"  # <job>-<index>.<service>
    assert pod0 in container["command"]
    port = free_port()

    def local(arg: str) -> str:
        return (arg.replace(CONFIG_FILE, str(config)).replace(RUNS_DIR + "/", f"{claim}/")
                .replace(pod0, f"127.0.0.1:{port}"))

    assert container["command"][0] == "crosstrain"
    command = [sys.executable, "-m", "crosstrain", *map(local, container["command"][1:])]
    pod_env = {e["name"]: e["value"] for e in container["env"]}
    pods = [subprocess.Popen(command, env=_env({**pod_env, "JOB_COMPLETION_INDEX": str(i), "HOSTNAME": f"tiny-{i}"}),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(job["spec"]["completions"])]
    logs = [pod.communicate(timeout=300)[0] for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], "\n".join(log[-2000:] for log in logs)
    summary = json.loads((claim / "tiny" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4 and not summary["preempted"]
    assert (claim / "tiny" / "checkpoints" / "step_4").is_dir()

    reference = subprocess.run([sys.executable, "-m", "crosstrain", "train", str(config), "--nproc", "2",
                                "--run-dir", str(tmp_path / "reference")],
                               env=_env({}), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert summary["params_sha256"] == expected["params_sha256"]
    assert summary["losses"] == expected["losses"]
