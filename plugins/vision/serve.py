"""``crosstrain serve`` on an image run: the version being served and, with ``--watch``, the poller that loads each
newer verified checkpoint of the run (``--best``: each new best), gates it and swaps it in, as the language-model
server's :class:`~crosstrain.plugins.serve.manager.ModelManager` does (same events, same verification). The gate:
finite outputs on a fixed input, and a finite eval loss where the run recorded one for that step."""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from crosstrain.checkpoint.manager import find_best, step_dirs
from crosstrain.checkpoint.resolve import Resolved
from crosstrain.checkpoint.verify import verify
from crosstrain.errors import CheckpointError, CrosstrainError
from crosstrain.plugins.vision.load import ImageModel, load_image_model


@dataclass(eq=False)
class ImageVersion:
    number: int
    model: ImageModel
    gate: dict[str, Any]
    loaded_at: float = field(default_factory=time.time)

    def describe(self) -> dict[str, Any]:
        m = self.model
        return {"version": self.number, "recipe": m.recipe, "source": m.source, "step": m.step,
                "params_sha256": m.params_sha256, "loaded_at": self.loaded_at, "engine": "torch",
                "classes": m.classes, "input": {"channels": m.channels, "size": list(m.shape[1:])}, "gate": self.gate}


@torch.no_grad()
def gate(model: ImageModel) -> dict[str, Any]:
    """``{"passed", "reason", "eval_loss"}``: finite outputs on a fixed mid-grey input, and the eval loss the run's
    metrics.jsonl holds for this step (if any) finite."""
    from crosstrain.plugins.serve.gate import recorded_eval_loss

    found, loss = recorded_eval_loss(model.run_dir, model.step)
    if found and not (loss is not None and math.isfinite(loss)):
        return {"passed": False, "reason": f"the eval loss recorded for step {model.step} is {loss}", "eval_loss": loss}
    grey = torch.full(model.shape, 128, dtype=torch.uint8)
    if model.recipe == "classify":
        out = model.model(model.preprocess([grey]))
        finite = bool(torch.isfinite(out).all())
    else:
        det = model.model([grey.float() / 255])[0]
        finite = all(bool(torch.isfinite(v.float()).all()) for v in det.values())
    if not finite:
        return {"passed": False, "reason": "the model's outputs on the gate image are not finite (NaN/inf weights)",
                "eval_loss": loss}
    return {"passed": True, "reason": "finite outputs" + (", finite recorded eval loss" if found else ""),
            "eval_loss": loss}


class ImageManager:
    """Holds the serving :class:`ImageVersion`; ``events`` keeps the last loads, swaps and refusals (also printed
    to stderr as ``crosstrain serve: {json}`` lines, as the language-model server prints them)."""

    def __init__(self, source: str, *, watch: bool, best: bool, poll_s: float) -> None:
        self.best, self.poll_s = best, poll_s
        self.events: deque[dict[str, Any]] = deque(maxlen=50)
        self._tried: set[tuple[int, str]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        model = load_image_model(source, best=best)
        version = ImageVersion(1, model, gate(model))
        if not version.gate["passed"]:
            raise CheckpointError(f"{model.source} failed the serving gate: {version.gate['reason']}; pass another "
                                  "checkpoint")
        if model.step is not None:
            self._tried.add((model.step, model.source))
        self.current = version
        self._event("loaded", version)
        self.run_dir = model.run_dir if watch else None

    def start(self) -> None:
        if self.run_dir is not None:
            self._thread = threading.Thread(target=self._watch, name="crosstrain-serve-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as exc:  # a watcher that dies silently would stop updates: log and keep polling
                self._event("error", None, reason=f"{type(exc).__name__}: {exc}")

    def poll(self) -> ImageVersion | None:
        """Look once for a newer checkpoint; load, gate and swap it in. Returns the new version, if any."""
        assert self.run_dir is not None
        for step, path in self._candidates(self.run_dir / "checkpoints"):
            self._tried.add((step, str(path)))
            if not self.best:  # find_best verified the best one already
                problems = verify(path).problems
                if problems:
                    self._event("refused", None, step=step, path=str(path), reason=f"verification: {problems[0]}")
                    continue
            try:
                model = load_image_model(Resolved("checkpoint", path, self.run_dir, step, True))
            except CrosstrainError as exc:
                self._event("refused", None, step=step, path=str(path), reason=str(exc))
                continue
            version = ImageVersion(self.current.number + 1, model, gate(model))
            if not version.gate["passed"]:
                self._event("refused", version, reason=version.gate["reason"])
                continue
            self.current = version  # the swap: requests that arrive from now on are answered by it
            self._event("swapped", version)
            return version
        return None

    def _candidates(self, folder: Path) -> list[tuple[int, Path]]:
        current = self.current.model.step if self.current.model.step is not None else -1
        if self.best:
            info = find_best(folder)
            if info is None or info.step == current or (info.step, str(info.path)) in self._tried:
                return []
            return [(info.step, info.path)]
        return [(s, p) for s, p in step_dirs(folder) if s > current and (s, str(p)) not in self._tried]

    def _event(self, kind: str, version: ImageVersion | None, **extra: Any) -> None:
        event: dict[str, Any] = {"event": kind, "time": time.time()}
        if version is not None:
            event.update(version=version.number, step=version.model.step, source=version.model.source,
                         params_sha256=version.model.params_sha256, gate=version.gate)
        event.update(extra)
        self.events.append(event)
        print(f"crosstrain serve: {json.dumps(event)}", file=sys.stderr, flush=True)


def serve_images(options: Any) -> int:
    """``crosstrain serve`` on an image run (``options``: :class:`~crosstrain.plugins.serve.config.ServeOptions`;
    the text-generation knobs do not apply). Binds first, loads and gates, then serves until SIGINT/SIGTERM."""
    import uvicorn

    from crosstrain.errors import ConfigError
    from crosstrain.plugins.serve.auth import require_api_key
    from crosstrain.plugins.serve.server import _default_name, bind
    from crosstrain.plugins.serve.shutdown import FLUSH_S, GracefulServer, InFlight
    from crosstrain.plugins.vision.serve_app import create_image_app

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # loading is cut short like the LM server's
    if options.engine != "torch":
        raise ConfigError("an image run is served with --engine torch (onnxruntime serves the language models); "
                          "drop --engine")
    sock = bind(options.host, options.port)
    manager = None
    try:
        if options.threads:
            torch.set_num_threads(options.threads)
        manager = ImageManager(options.source, watch=options.watch, best=options.best, poll_s=options.poll_s)
        name = options.model_name or _default_name(options.source)
        app = create_image_app(name, manager)
        require_api_key(app, options.api_key)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=options.shutdown_grace_s + FLUSH_S)
        host = options.host if options.host not in ("0.0.0.0", "::") else "127.0.0.1"
        url = f"http://{host}:{sock.getsockname()[1]}"
        v = manager.current
        watching = f", watching {manager.run_dir}" if manager.run_dir else ""
        banner = (f"crosstrain serve: listening on {url}/v1/images/{v.model.recipe} (model {name!r}, "
                  f"{v.model.recipe}, step {v.model.step}{watching})")
        server = GracefulServer(config, InFlight(), options.shutdown_grace_s, lambda: print(banner, flush=True))
        manager.start()
        server.run(sockets=[sock])
        print(server.summary(), file=sys.stderr)
    except KeyboardInterrupt:
        print("crosstrain serve: stopped before it was serving", file=sys.stderr)
    finally:
        if manager is not None:
            manager.stop()
        sock.close()
    return 0
