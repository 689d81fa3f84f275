"""``crosstrain k8s [CONFIG] --nodes N [--nproc-per-node M] [--backend B] [--image IMG] [--run-dir-claim PVC]
[--kind indexed-job|jobset|pytorchjob] [--out DIR] [--set K=V ...]``: Kubernetes manifests for a run (docs/cluster.md).

Every flag and the config are checked (for a world of N x M ranks) before anything is written; a bad one is a
one-line error, exit 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

from crosstrain.errors import ConfigError

#: a DNS-1035 label (Service and pod hostnames must be one).
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: a DNS-1123 subdomain (a PersistentVolumeClaim's name).
_CLAIM_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
#: a Kubernetes quantity such as 8, 500m, 16Gi.
_QUANTITY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("k8s", help="write Kubernetes manifests that run `crosstrain train` on N pods",
                              description="Writes an Indexed Job and a headless Service (or a JobSet, or a Kubeflow "
                                          "PyTorchJob), the config as a ConfigMap and a claim for the run dir, as "
                                          "YAML files in --out; apply them with `kubectl apply -f DIR`.")
    p.add_argument("config", nargs="?", default=None, help="TOML config file (default: the embedded defaults)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key, as crosstrain train")
    p.add_argument("--nodes", type=int, required=True, help="pods (one per node)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="worker processes (devices) per pod (default 1)")
    p.add_argument("--backend", default=None, help="the backend the pods train on; it decides the device resource "
                   "they request (`crosstrain backends` lists them; default: the config's `backend`)")
    p.add_argument("--image", default="crosstrain:latest", help="container image with crosstrain and the "
                   "backend's torch build installed (default crosstrain:latest)")
    p.add_argument("--name", default="crosstrain", help="name of the job, its Service, ConfigMap and run dir "
                   "(a DNS label; default crosstrain)")
    p.add_argument("--run-dir-claim", default="", metavar="PVC", help="existing ReadWriteMany PersistentVolumeClaim "
                   "for the run dirs (default: write a new claim NAME-runs)")
    p.add_argument("--storage", default="50Gi", help="size of that new claim (default 50Gi)")
    p.add_argument("--kind", default="indexed-job", choices=("indexed-job", "jobset", "pytorchjob"),
                   help="the workload (default indexed-job)")
    p.add_argument("--max-restarts", type=int, default=3, help="elastic restarts of the workers, and of failed "
                   "pods or job sets (default 3)")
    p.add_argument("--grace-period", type=int, default=300, metavar="S", help="seconds between SIGTERM and SIGKILL: "
                   "enough to finish a step and save a checkpoint (default 300)")
    p.add_argument("--cpu", default=None, help="CPU request per pod (default: 4 per process)")
    p.add_argument("--memory", default=None, help="memory request and limit per pod (default: 16Gi per process)")
    p.add_argument("--out", default=None, metavar="DIR", help="folder for the YAML files (default k8s/NAME)")
    p.set_defaults(func=_k8s)


def _check_flags(args: argparse.Namespace) -> None:
    """Every flag that needs neither the config nor the backends; raises ConfigError."""
    if importlib.util.find_spec("yaml") is None:
        raise ConfigError('crosstrain k8s needs PyYAML (not installed); run: pip install "crosstrain[k8s]"')
    if args.nodes < 1:
        raise ConfigError(f"--nodes={args.nodes} must be >= 1")
    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node={args.nproc_per_node} must be >= 1")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts={args.max_restarts} must be >= 0")
    if args.grace_period < 1:
        raise ConfigError(f"--grace-period={args.grace_period} must be >= 1 second")
    # the longest name derived from it, a JobSet pod's hostname <name>-workers-0-<index>, must stay a DNS label
    longest = len(f"{args.name}-workers-0-{args.nodes - 1}")
    if not _NAME_RE.match(args.name) or longest > 63:
        raise ConfigError(f"--name={args.name!r} must be a DNS label (lowercase letters, digits and '-', starting "
                          f"with a letter) short enough that '{args.name}-workers-0-{args.nodes - 1}' has at most "
                          "63 characters")
    if args.run_dir_claim and (not _CLAIM_RE.match(args.run_dir_claim) or len(args.run_dir_claim) > 253):
        raise ConfigError(f"--run-dir-claim={args.run_dir_claim!r} is not a PersistentVolumeClaim name (lowercase "
                          "letters, digits, '-' and '.')")
    if not args.image or any(ch.isspace() for ch in args.image):
        raise ConfigError(f"--image={args.image!r} must be an image reference without spaces, e.g. "
                          "registry.example.com/crosstrain:0.1")
    for flag, value in (("--cpu", args.cpu), ("--memory", args.memory), ("--storage", args.storage)):
        if value is not None and not _QUANTITY_RE.match(value):
            raise ConfigError(f"{flag}={value!r} is not a Kubernetes quantity (e.g. 8, 500m, 16Gi)")
    out = Path(args.out or f"k8s/{args.name}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out={out} is a file; name a folder")


def _device_resource(backend: str) -> str:
    """The backend's Kubernetes extended resource ("" for none); "auto" or an unknown backend is a ConfigError."""
    from crosstrain.registry import backends

    found = backends()
    names = "|".join(sorted(found))
    if backend == "auto":
        raise ConfigError(f"pods ask for devices by backend: pass --backend {names} (or set `backend` in the config)")
    if backend not in found:
        raise ConfigError(f"backend {backend!r} is not a discovered backend; pass --backend {names}")
    return found[backend].k8s_resource


def _k8s(args: argparse.Namespace) -> int:
    _check_flags(args)
    from crosstrain.config import check_world, load_config
    from crosstrain.config.toml_io import dumps_toml
    from crosstrain.engine.recipe import resolve_recipe
    from crosstrain.plugins.k8s.manifests import K8sRun, manifests

    config = load_config(args.config, [*(args.set or []), *([f"backend={args.backend}"] if args.backend else [])])
    resource = _device_resource(config.backend)
    check_world(config, args.nodes * args.nproc_per_node)
    resolve_recipe(config.train.recipe)
    run = K8sRun(name=args.name, image=args.image, config_toml=dumps_toml(config.to_dict()), nodes=args.nodes,
                 nproc_per_node=args.nproc_per_node, device_resource=resource,
                 cpu=args.cpu or str(4 * args.nproc_per_node), memory=args.memory or f"{16 * args.nproc_per_node}Gi",
                 max_restarts=args.max_restarts, grace_s=args.grace_period, claim=args.run_dir_claim,
                 storage=args.storage)
    out = Path(args.out or f"k8s/{args.name}")
    written = write_manifests(manifests(run, args.kind), out)
    print(f"crosstrain k8s: wrote {', '.join(p.name for p in written)} to {out}; apply with: kubectl apply -f {out}")
    return 0


def write_manifests(objects: dict[str, dict], out: Path) -> list[Path]:
    """Write each object as a YAML file in ``out`` (atomically); returns the paths."""
    import yaml

    from crosstrain.checkpoint.atomic import atomic_write

    class Dumper(yaml.SafeDumper):
        """Multi-line strings (the ConfigMap's config.toml) as literal blocks, readable in the file."""

    Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                                  style="|" if "\n" in s else None))
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, obj in objects.items():
        atomic_write(out / name, yaml.dump(obj, Dumper=Dumper, sort_keys=False, default_flow_style=False))
        paths.append(out / name)
    return paths
