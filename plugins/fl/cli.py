"""``crosstrain fl certs|server|client|simulate`` (docs/fl.md)."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

from crosstrain.errors import ConfigError


def check_extra() -> None:
    """The ``fl`` extra (cryptography, grpcio) is optional: say how to get it instead of an ImportError."""
    missing = [name for name, module in (("cryptography", "cryptography"), ("grpcio", "grpc"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"crosstrain fl needs {' and '.join(missing)} (not installed); "
                          'run: pip install "crosstrain[fl]"')


def _with_extra(command: Any) -> Any:
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        check_extra()
        # gRPC's core logs to stderr on its own (a failed bind, every refused TLS handshake) ahead of our one-line
        # errors; it reads this before it is first imported. GRPC_VERBOSITY=ERROR (or DEBUG) brings it back.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
        return int(command(args))

    return run


def _config(args: argparse.Namespace, extra: list[str] | None = None) -> Any:
    from crosstrain.config import load_config

    return load_config(args.config, [*(args.set or []), *(extra or [])])


def _run_dir(args: argparse.Namespace, config: Any) -> Path:
    if args.run_dir:
        path = Path(args.run_dir)
        if path.is_file():
            raise ConfigError(f"--run-dir {args.run_dir!r} is a file; pass a directory")
        return path
    from crosstrain.engine.state import new_run_dir

    return new_run_dir(Path(config.train.output_dir) / "fl")


def _certs_dir(fl: Any) -> str:
    if not fl.certs:
        raise ConfigError("fl.certs is empty; create certificates with `crosstrain fl certs DIR --clients N` and "
                          "pass --set fl.certs=DIR")
    return str(fl.certs)


def run_certs(args: argparse.Namespace) -> int:
    from crosstrain.plugins.fl.certs import generate

    out = generate(args.dir, args.clients)
    print(f"wrote a CA, a server certificate (localhost, 127.0.0.1) and {args.clients} client certificates to {out}")
    return 0


def run_server(args: argparse.Namespace) -> int:
    from crosstrain.checkpoint.atomic import atomic_write
    from crosstrain.plugins.fl.certs import load
    from crosstrain.plugins.fl.coordinator import Coordinator
    from crosstrain.plugins.fl.grpc_transport import check_free, serve
    from crosstrain.plugins.fl.server import FLServer, fl_section

    config = _config(args)
    fl = fl_section(config)
    identity = load(_certs_dir(fl), "server")
    check_free(fl.address)  # a busy port is refused before the model is built or anything is written
    run_dir = _run_dir(args, config)
    coordinator = Coordinator()
    server = FLServer(config, run_dir, coordinator)  # validates and resumes before anything listens
    grpc_server, port = serve(coordinator, identity, fl.address, fl.clients)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / "address", f"{fl.host_port[0]}:{port}".encode())
        print(f"fl server listening on {fl.host_port[0]}:{port} (TLS, client certificates required), "
              f"run dir {run_dir}", flush=True)
        summary = server.run()
        coordinator.wait_done(summary_clients(summary, server), timeout_s=10.0)
    finally:
        grpc_server.stop(grace=1.0)
    print(json.dumps({k: summary[k] for k in ("rounds", "clients", "secure", "final_loss", "dropped_clients")}))
    return 0


def summary_clients(summary: dict[str, Any], server: Any) -> set[int]:
    """Clients that should hear ``done`` before the server exits: those seen and not dropped."""
    return set(server.clients_seen) - set(summary["dropped_clients"])


def run_client(args: argparse.Namespace) -> int:
    from crosstrain.plugins.fl.certs import load
    from crosstrain.plugins.fl.client import FLClient
    from crosstrain.plugins.fl.grpc_transport import GrpcChannel
    from crosstrain.plugins.fl.server import fl_section
    from crosstrain.plugins.fl.training import run_client as train_client

    config = _config(args)
    fl = fl_section(config)
    if args.id is None:
        raise ConfigError("--id is required: it picks client-<id>.crt/.key in fl.certs")
    identity = load(_certs_dir(fl), f"client-{args.id}")
    address = fl.address
    if fl.host_port[1] == 0:
        raise ConfigError("fl.address has port 0; pass the server's HOST:PORT (its run dir's `address` file)")
    client = FLClient(GrpcChannel(address, identity, fl.stage_timeout_s), fl.join_timeout_s)
    run_dir = _run_dir(args, config)
    summary = train_client(config, run_dir, client)
    print(json.dumps(summary))
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    from crosstrain.plugins.fl.simulate import simulate

    if args.clients is not None and args.clients < 1:
        raise ConfigError(f"--clients {args.clients}: a federation needs at least one client; pass --clients N >= 1 "
                          "(or leave it out for fl.clients)")
    clients = [] if args.clients is None else [f"fl.clients={args.clients}"]
    config = _config(args, clients)
    run_dir = _run_dir(args, config)
    started = time.perf_counter()
    summary = simulate(args.config, [*(args.set or []), *clients], config, run_dir)
    print(json.dumps({k: summary.get(k) for k in ("rounds", "clients", "secure", "final_loss", "dropped_clients")}
                     | {"wall_s": round(time.perf_counter() - started, 1), "run_dir": str(run_dir)}))
    return 0 if summary.get("ok") else 1


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, help="TOML config with an [fl] section (optional)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key, e.g. --set fl.rounds=8")
    p.add_argument("--run-dir", default=None, help="run directory (default: <train.output_dir>/fl/<timestamp>)")


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    fl = subparsers.add_parser("fl", help="federated learning: secure aggregation over TLS (docs/fl.md)")
    sub = fl.add_subparsers(dest="fl_command", metavar="COMMAND", required=True)
    p = sub.add_parser("certs", help="create a test CA, a server certificate and N client certificates")
    p.add_argument("dir")
    p.add_argument("--clients", type=int, required=True)
    p.set_defaults(func=_with_extra(run_certs))
    p = sub.add_parser("server", help="aggregate fl.rounds rounds from the clients")
    _common(p)
    p.set_defaults(func=_with_extra(run_server))
    p = sub.add_parser("client", help="train on this client's shard and send updates to the server")
    _common(p)
    p.add_argument("--id", type=int, default=None, help="which client-<id> certificate of fl.certs to use")
    p.set_defaults(func=_with_extra(run_client))
    p = sub.add_parser("simulate", help="one server and N client processes on 127.0.0.1")
    _common(p)
    p.add_argument("--clients", type=int, default=None, help="number of clients (fl.clients)")
    p.set_defaults(func=_with_extra(run_simulate))
