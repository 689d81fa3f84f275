"""`crosstrain k8s`: the manifests validate against the Kubernetes API's published JSON schemas (kubernetes-validate,
strict: an unknown or misspelled field fails) for 3 backends x 2 node counts x 3 kinds, the rendezvous name is the
first pod's DNS name, and every bad flag is one line, exit 2, nothing written. No cluster exists here: the pods'
command lines run as local processes in tests/test_k8s_pods.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from in_process import crosstrain_main
from one_line import one_line_error

from crosstrain.config import load_config
from crosstrain.plugins.k8s.manifests import CONFIG_FILE, RDZV_PORT, RUNS_DIR

#: the oldest and the newest Kubernetes whose schemas kubernetes-validate ships and the manifests must fit
VERSIONS = ("1.29", "1.37")
RESOURCES = {"cuda": "nvidia.com/gpu", "rocm": "amd.com/gpu", "npu": "huawei.com/Ascend910"}
#: the custom resources' top-level spec fields, from their CRDs (jobset.x-k8s.io v1alpha2, kubeflow.org v1)
JOBSET_SPEC = {"coordinator", "failurePolicy", "managedBy", "network", "replicatedJobs", "startupPolicy",
               "successPolicy", "suspend", "ttlSecondsAfterFinished"}
JOBSET_REPLICATED_JOB = {"dependsOn", "groupName", "name", "replicas", "template"}
JOBSET_NETWORK = {"enableDNSHostnames", "publishNotReadyAddresses", "subdomain"}
PYTORCHJOB_SPEC = {"elasticPolicy", "nprocPerNode", "pytorchReplicaSpecs", "runPolicy"}
PYTORCHJOB_ELASTIC = {"maxReplicas", "maxRestarts", "metrics", "minReplicas", "nProcPerNode", "rdzvBackend",
                      "rdzvConf", "rdzvHost", "rdzvId", "rdzvPort", "standalone"}
PYTORCHJOB_REPLICA = {"replicas", "restartPolicy", "template"}


def validate(obj: dict[str, Any]) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def generate(tmp_path: Path, backend: str, nodes: int, kind: str, *extra: str) -> dict[str, dict[str, Any]]:
    out = tmp_path / f"{kind}-{backend}-{nodes}"
    argv = ["k8s", "--nodes", str(nodes), "--nproc-per-node", "2", "--backend", backend, "--kind", kind,
            "--name", "lm", "--out", str(out), "--set", "train.steps=50", *extra]
    assert crosstrain_main(argv) == 0
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(out.iterdir())}


def pod_template_checks(template: dict[str, Any], backend: str, nodes: int, host: str) -> None:
    """The command asks for 2 processes on each of ``nodes`` pods, rendezvous at ``host``; 2 devices requested."""
    container = template["spec"]["containers"][0]
    cmd = container["command"]
    assert cmd[:3] == ["crosstrain", "train", CONFIG_FILE]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=True))
    assert flags == {"--run-dir": f"{RUNS_DIR}/lm", "--nproc": "2", "--nnodes": str(nodes),
                     "--rdzv-endpoint": f"{host}:{RDZV_PORT}", "--rdzv-id": "lm", "--max-restarts": "3",
                     "--preempted-exit-code": "143"}
    assert container["resources"]["limits"][RESOURCES[backend]] == "2"
    assert template["spec"]["terminationGracePeriodSeconds"] == 300
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes[mounts[RUNS_DIR]]["persistentVolumeClaim"]["claimName"] == "lm-runs"
    assert volumes[mounts["/etc/crosstrain"]]["configMap"]["name"] == "lm-config"


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("backend", ["cuda", "rocm", "npu"])
def test_manifests_validate_against_the_api_schema(tmp_path, backend, nodes) -> None:
    files = generate(tmp_path, backend, nodes, "indexed-job")
    assert sorted(files) == ["configmap.yaml", "job.yaml", "pvc.yaml", "service.yaml"]
    for obj in files.values():
        validate(obj)
    job, service = files["job.yaml"], files["service.yaml"]
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", nodes, nodes)
    ignored = [rule.get("onExitCodes", {}).get("values") for rule in spec["podFailurePolicy"]["rules"]]
    assert [143] in ignored  # a pod stopped by a signal is replaced, and resumes, without counting as a failure
    # pod <job>-<index> in subdomain <service>: the headless Service selecting the Job's pods gives it DNS
    assert service["spec"]["clusterIP"] == "None" and spec["template"]["spec"]["subdomain"] == "lm"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    pod_template_checks(spec["template"], backend, nodes, f"{job['metadata']['name']}-0.{service['metadata']['name']}")
    # the ConfigMap holds the effective config, the backend and the override included
    config = Path(tmp_path / "config.toml")
    config.write_text(files["configmap.yaml"]["data"]["config.toml"])
    loaded = load_config(str(config))
    assert loaded.to_dict() == load_config(None, ["train.steps=50", f"backend={backend}"]).to_dict()

    jobset = generate(tmp_path, backend, nodes, "jobset")["jobset.yaml"]
    assert set(jobset["spec"]) <= JOBSET_SPEC and set(jobset["spec"]["network"]) <= JOBSET_NETWORK
    (replicated,) = jobset["spec"]["replicatedJobs"]
    assert set(replicated) <= JOBSET_REPLICATED_JOB
    validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "lm-workers-0"},
              **{k: v for k, v in replicated["template"].items() if k != "metadata"}})
    pod_template_checks(replicated["template"]["spec"]["template"], backend, nodes,
                        f"lm-{replicated['name']}-0-0.lm")  # <jobset>-<job>-<job index>-<pod index>.<subdomain>

    ptj = generate(tmp_path, backend, nodes, "pytorchjob")["pytorchjob.yaml"]
    assert set(ptj["spec"]) <= PYTORCHJOB_SPEC and set(ptj["spec"]["elasticPolicy"]) <= PYTORCHJOB_ELASTIC
    worker = ptj["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert set(ptj["spec"]["pytorchReplicaSpecs"]) == {"Worker"} and set(worker) <= PYTORCHJOB_REPLICA
    assert worker["replicas"] == nodes and worker["template"]["spec"]["containers"][0]["name"] == "pytorch"
    validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "lm-worker"},
              "template": worker["template"]})
    pod_template_checks(worker["template"], backend, nodes, "lm-worker-0")


def test_cpu_pods_ask_for_cpu_and_memory_only(tmp_path) -> None:
    out = tmp_path / "cpu"
    argv = ["k8s", "--nodes", "2", "--backend", "cpu", "--cpu", "3", "--memory", "6Gi", "--run-dir-claim",
            "shared-runs", "--out", str(out)]
    assert crosstrain_main(argv) == 0
    job = yaml.safe_load((out / "job.yaml").read_text())
    validate(job)
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "3", "memory": "6Gi"},
                                                 "limits": {"memory": "6Gi"}}
    assert pod["volumes"][1]["persistentVolumeClaim"]["claimName"] == "shared-runs"
    assert not (out / "pvc.yaml").exists()  # an existing claim is used, none is written


def test_a_misspelled_field_fails_the_validation(tmp_path) -> None:
    """The check the tests above rely on is strict: one wrong field name anywhere in the pod is refused."""
    job = generate(tmp_path, "cuda", 2, "indexed-job")["job.yaml"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["volumeMount"] = container.pop("volumeMounts")
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        validate(job)


@pytest.mark.parametrize("argv, needle", [
    (["--nodes", "0", "--backend", "cuda"], "--nodes=0 must be >= 1"),
    (["--nodes", "2", "--nproc-per-node", "0", "--backend", "cuda"], "--nproc-per-node=0 must be >= 1"),
    (["--nodes", "2", "--backend", "tpu"], "backend 'tpu' is not a discovered backend; pass --backend cpu|"),
    (["--nodes", "2"], "pods ask for devices by backend: pass --backend cpu|"),
    (["--nodes", "2", "--backend", "cuda", "--name", "My_Run"], "--name='My_Run' must be a DNS label"),
    (["--nodes", "2", "--backend", "cuda", "--name", "a" * 60], "at most 63 characters"),
    (["--nodes", "2", "--backend", "cuda", "--run-dir-claim", "Runs!"], "is not a PersistentVolumeClaim name"),
    (["--nodes", "2", "--backend", "cuda", "--image", "my image"], "must be an image reference"),
    (["--nodes", "2", "--backend", "cuda", "--memory", "16GB"], "--memory='16GB' is not a Kubernetes quantity"),
    (["--nodes", "2", "--backend", "cuda", "--max-restarts", "-1"], "--max-restarts=-1 must be >= 0"),
    (["--nodes", "2", "--backend", "cuda", "--grace-period", "0"], "--grace-period=0 must be >= 1"),
    (["--nodes", "2", "--backend", "cuda", "--set", "train.stepz=3"], "unknown config key 'train.stepz'"),
    (["--nodes", "2", "--backend", "cuda", "--set", "parallel.tp=3"], "does not divide the world size 2"),
    (["--nodes", "2", "--backend", "cuda", "--kind", "deployment"], "invalid choice: 'deployment'"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, argv, needle) -> None:
    out = tmp_path / "out"
    assert crosstrain_main(["k8s", *argv, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert needle in one_line_error(captured.out, captured.err)[-1]
    assert not out.exists()


def test_out_naming_a_file_is_refused(tmp_path, capsys) -> None:
    out = tmp_path / "manifests"
    out.write_text("keep me")
    assert crosstrain_main(["k8s", "--nodes", "1", "--backend", "cpu", "--out", str(out)]) == 2
    assert "is a file; name a folder" in one_line_error(*capsys.readouterr())[-1]
    assert out.read_text() == "keep me"


def test_multi_node_train_needs_a_shared_run_dir(tmp_path, capsys) -> None:
    """Each node would otherwise pick its own timestamped run dir (and, before, its own rendezvous id)."""
    runs = tmp_path / "runs"
    argv = ["train", "--nproc", "1", "--nnodes", "2", "--set", f"train.output_dir={runs}"]
    assert crosstrain_main(argv) == 2
    assert "--nnodes=2 needs --run-dir DIR" in one_line_error(*capsys.readouterr())[-1]
    assert not runs.exists()
