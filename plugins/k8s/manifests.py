"""The Kubernetes objects of one ``crosstrain train`` run, as plain dicts (``crosstrain k8s`` writes them as YAML).

Every pod runs the same command: ``crosstrain train CONFIG --nproc M --nnodes N --rdzv-endpoint HOST:PORT
--rdzv-id NAME --max-restarts R --run-dir /runs/NAME``, i.e. torchrun's elastic agent in process
(:mod:`crosstrain.launch`) with c10d rendezvous hosted by the first pod, whose stable DNS name comes from a headless
Service (Indexed Job), from the JobSet controller's own Service, or from the training operator's per-replica
Service (PyTorchJob). c10d assigns the ranks, so the command does not depend on the pod's index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: where the pod finds the run's config (a ConfigMap) and the run dirs (the claim).
CONFIG_DIR = "/etc/crosstrain"
CONFIG_FILE = f"{CONFIG_DIR}/config.toml"
RUNS_DIR = "/runs"
#: the c10d rendezvous port on the first pod (torchrun's usual one).
RDZV_PORT = 29500
KINDS = ("indexed-job", "jobset", "pytorchjob")
#: what a pod exits with when a signal stopped the run early, after its checkpoint: 128 + SIGTERM, as if the signal
#: had ended it. The Jobs replace such pods without counting them as failures; they resume from the run dir.
PREEMPTED_EXIT_CODE = 143
#: the JobSet's one replicated job, and the PyTorchJob's replica type (its Services are ``<name>-worker-<i>``).
JOBSET_REPLICATED_JOB = "workers"


@dataclass(frozen=True)
class K8sRun:
    """What the manifests of one run depend on (``crosstrain k8s``'s flags, checked by the CLI)."""

    name: str  # DNS-1035 label: the Job/JobSet/PyTorchJob, its Service, ConfigMap and run dir are named after it
    image: str  # an image with crosstrain (and the backend's torch build) installed
    config_toml: str  # the effective config, mounted at CONFIG_FILE
    nodes: int  # pods
    nproc_per_node: int  # worker processes (devices) per pod
    device_resource: str  # the backend's Kubernetes extended resource ("" = cpu/memory only)
    cpu: str  # CPU request per pod (a Kubernetes quantity)
    memory: str  # memory request and limit per pod
    max_restarts: int  # torchrun's worker restarts, and the pod/job restarts of the controller
    grace_s: int  # terminationGracePeriodSeconds: time to finish the step and save after SIGTERM
    claim: str = ""  # an existing PersistentVolumeClaim for /runs; "" = a new ReadWriteMany claim `<name>-runs`
    storage: str = "50Gi"  # size of that new claim

    @property
    def run_dir(self) -> str:
        return f"{RUNS_DIR}/{self.name}"

    @property
    def claim_name(self) -> str:
        return self.claim or f"{self.name}-runs"


def rdzv_host(run: K8sRun, kind: str) -> str:
    """The first pod's stable DNS name (short form: pods resolve it within the namespace)."""
    if kind == "indexed-job":  # hostname <job>-<index>, subdomain = the headless Service
        return f"{run.name}-0.{run.name}"
    if kind == "jobset":  # <jobset>-<replicated job>-<job index>-<pod index>.<jobset> (its network subdomain)
        return f"{run.name}-{JOBSET_REPLICATED_JOB}-0-0.{run.name}"
    return f"{run.name}-worker-0"  # the training operator's Service of worker replica 0


def train_command(run: K8sRun, kind: str) -> list[str]:
    """The container's command: the elastic launcher of ``crosstrain train``, as PID 1 so SIGTERM reaches it."""
    return ["crosstrain", "train", CONFIG_FILE, "--run-dir", run.run_dir, "--nproc", str(run.nproc_per_node),
            "--nnodes", str(run.nodes), "--rdzv-endpoint", f"{rdzv_host(run, kind)}:{RDZV_PORT}",
            "--rdzv-id", run.name, "--max-restarts", str(run.max_restarts),
            "--preempted-exit-code", str(PREEMPTED_EXIT_CODE)]


def _resources(run: K8sRun) -> dict[str, Any]:
    requests: dict[str, str] = {"cpu": run.cpu, "memory": run.memory}
    limits: dict[str, str] = {"memory": run.memory}
    if run.device_resource:  # extended resources are requested as limits (requests default to them)
        limits[run.device_resource] = str(run.nproc_per_node)
    return {"requests": requests, "limits": limits}


def pod_spec(run: K8sRun, kind: str, restart_policy: str) -> dict[str, Any]:
    """The pod: one container running :func:`train_command`, the config and run-dir volumes, a memory-backed
    /dev/shm (the collectives' and data loaders' shared memory; the runtime's default is 64 MiB)."""
    container: dict[str, Any] = {
        "name": "pytorch" if kind == "pytorchjob" else "train",  # the training operator finds its container by name
        "image": run.image,
        "command": train_command(run, kind),
        "ports": [{"name": "pytorchjob-port" if kind == "pytorchjob" else "rdzv", "containerPort": RDZV_PORT}],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "resources": _resources(run),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "runs", "mountPath": RUNS_DIR},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    # The kubelet sends SIGTERM to PID 1, which is crosstrain's launcher (exec form, no shell), and waits the grace
    # period: crosstrain finishes the step, saves a checkpoint and exits (docs/checkpointing.md). No preStop hook:
    # one that signalled too would make the kubelet's SIGTERM the second, which kills at once. lifecycle.stopSignal
    # is left out (API servers before 1.33 reject it as an unknown field): the image's STOPSIGNAL must be SIGTERM,
    # the default.
    return {
        "restartPolicy": restart_policy,
        "terminationGracePeriodSeconds": run.grace_s,
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": f"{run.name}-config"}},
                    {"name": "runs", "persistentVolumeClaim": {"claimName": run.claim_name}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }


def _labels(run: K8sRun) -> dict[str, str]:
    return {"app.kubernetes.io/name": "crosstrain", "app.kubernetes.io/instance": run.name}


def _metadata(run: K8sRun, name: str) -> dict[str, Any]:
    return {"name": name, "labels": _labels(run)}


def indexed_job_spec(run: K8sRun, kind: str) -> dict[str, Any]:
    """N pods that start together, one per index. A pod that a node drain or preemption removes (condition
    DisruptionTarget), and one that stopped early after a signal here or on another pod (exit 143, after a
    checkpoint), is replaced without counting against ``backoffLimit``: the replacements resume the run."""
    template_spec = pod_spec(run, kind, "Never")
    if kind == "indexed-job":
        template_spec["subdomain"] = run.name  # <job>-<index>.<service> resolves to the pod
    return {
        "completionMode": "Indexed",
        "completions": run.nodes,
        "parallelism": run.nodes,
        "backoffLimit": run.max_restarts,
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [PREEMPTED_EXIT_CODE]}}]},
        "template": {"metadata": {"labels": _labels(run)}, "spec": template_spec},
    }


def config_map(run: K8sRun) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(run, f"{run.name}-config"),
            "data": {"config.toml": run.config_toml}}


def claim(run: K8sRun) -> dict[str, Any]:
    """A claim every pod mounts read-write at once (the run dir is shared: checkpoints, lock, summary)."""
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _metadata(run, run.claim_name),
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": run.storage}}}}


def headless_service(run: K8sRun) -> dict[str, Any]:
    """DNS records for the Job's pods, published before they are ready (the rendezvous runs before any probe)."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(run, run.name),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {"batch.kubernetes.io/job-name": run.name},
                     "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT}]}}


def job(run: K8sRun) -> dict[str, Any]:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(run, run.name),
            "spec": indexed_job_spec(run, "indexed-job")}


def jobset(run: K8sRun) -> dict[str, Any]:
    """A JobSet (jobset.x-k8s.io) of one Indexed Job: its controller makes the headless Service and restarts the
    whole set (all pods, which resume from the run dir) up to ``maxRestarts`` times when a pod fails."""
    spec = indexed_job_spec(run, "jobset")
    spec["backoffLimit"] = 0  # a failed pod fails the Job and the JobSet restarts every pod together
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _metadata(run, run.name),
            "spec": {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                     "failurePolicy": {"maxRestarts": run.max_restarts},
                     "replicatedJobs": [{"name": JOBSET_REPLICATED_JOB, "replicas": 1,
                                         "template": {"metadata": {"labels": _labels(run)}, "spec": spec}}]}}


def pytorchjob(run: K8sRun) -> dict[str, Any]:
    """A Kubeflow PyTorchJob (kubeflow.org/v1) with an elastic policy: N workers, c10d rendezvous on worker 0."""
    template = {"metadata": {"labels": _labels(run)}, "spec": pod_spec(run, "pytorchjob", "OnFailure")}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(run, run.name),
            "spec": {"elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": run.nodes, "maxReplicas": run.nodes,
                                       "maxRestarts": run.max_restarts},
                     "runPolicy": {"backoffLimit": run.max_restarts},
                     "pytorchReplicaSpecs": {"Worker": {"replicas": run.nodes, "restartPolicy": "OnFailure",
                                                        "template": template}}}}


def manifests(run: K8sRun, kind: str = "indexed-job") -> dict[str, dict[str, Any]]:
    """``{file name: object}`` for ``kind``: the workload, its ConfigMap, a Service (Indexed Job only) and the claim
    (unless ``run.claim`` names an existing one)."""
    out: dict[str, dict[str, Any]] = {"configmap.yaml": config_map(run)}
    if not run.claim:
        out["pvc.yaml"] = claim(run)
    if kind == "indexed-job":
        out["service.yaml"] = headless_service(run)
        out["job.yaml"] = job(run)
    elif kind == "jobset":
        out["jobset.yaml"] = jobset(run)
    else:
        out["pytorchjob.yaml"] = pytorchjob(run)
    return out
