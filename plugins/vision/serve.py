"""``crosstrain serve`` on an image run: the version being served and, with ``--watch``, the poller that loads each
newer verified checkpoint of the run (``--best``: each new best), gates it and swaps it in: the language-model
server's :class:`~crosstrain.plugins.serve.watch.Watcher` (same events, same verification). The gate: finite
outputs on a fixed input, and a finite eval loss where the run recorded one for that step."""

from __future__ import annotations

import math
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from crosstrain.checkpoint.resolve import Resolved
from crosstrain.plugins.serve.watch import Watcher
from crosstrain.plugins.vision.load import ImageModel, load_image_model


@dataclass(eq=False)
class ImageVersion:
    number: int
    model: ImageModel
    gate: dict[str, Any]
    loaded_at: float = field(default_factory=time.time)

    @property
    def step(self) -> int | None:
        return self.model.step

    @property
    def source(self) -> str:
        return self.model.source

    @property
    def params_sha256(self) -> str:
        return self.model.params_sha256

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


class ImageManager(Watcher[ImageVersion]):
    """Holds the serving :class:`ImageVersion`; ``events`` keeps the last loads, swaps and refusals (also printed
    to stderr as ``crosstrain serve: {json}`` lines, as the language-model server prints them)."""

    def __init__(self, source: str, *, watch: bool, best: bool, poll_s: float) -> None:
        super().__init__(best=best, poll_s=poll_s)
        model = load_image_model(source, best=best)
        self._serve_first(ImageVersion(1, model, gate(model)))
        self.run_dir = model.run_dir if watch else None

    def _load(self, resolved: Resolved, number: int) -> ImageVersion:
        model = load_image_model(resolved)
        return ImageVersion(number, model, gate(model))

    def _gate(self, version: ImageVersion) -> dict[str, Any]:
        return version.gate


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
