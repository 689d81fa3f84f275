"""What ``crosstrain serve`` is asked to do, validated before anything loads."""

from __future__ import annotations

from dataclasses import dataclass, field

from crosstrain.errors import ConfigError

ENGINES = ("torch", "onnxruntime")


@dataclass(frozen=True)
class ServeOptions:
    """``source``: anything ``crosstrain generate`` takes (run dir, checkpoint, .safetensors, HF folder, .onnx).
    ``watch``: poll the run dir every ``poll_s`` for a newer verified checkpoint (``best``: a new best one).
    ``max_batch`` sequences share each decode step; an idle server waits up to ``max_wait_ms`` for more requests
    before starting a batch. ``model_name``: the id clients pass as ``model`` (default: the run dir's name).
    ``shutdown_grace_s``: on SIGTERM/SIGINT, how long replies in flight may run before they are ended (an SSE error
    event and ``[DONE]``); 10 s leaves room within Kubernetes' default 30 s before it sends SIGKILL. ``api_key``:
    see :mod:`crosstrain.plugins.serve.auth` (a host beyond loopback without one is refused here)."""

    source: str
    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "torch"
    watch: bool = False
    best: bool = False
    max_batch: int = 16
    max_wait_ms: float = 5.0
    poll_s: float = 2.0
    model_name: str | None = None
    threads: int | None = None
    shutdown_grace_s: float = 10.0
    #: the bearer key every /v1/ request must send (crosstrain.plugins.serve.auth); None: CROSSTRAIN_API_KEY's
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from crosstrain.plugins.serve.auth import api_key_for

        if self.api_key is None:  # frozen: set once, here, where every other option is checked
            object.__setattr__(self, "api_key", api_key_for(self.host))
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must lie in [0, 65535] (0 = any free port), got {self.port}")
        if self.max_batch < 1:
            raise ConfigError(f"--max-batch must be >= 1, got {self.max_batch}")
        if not self.max_wait_ms >= 0:
            raise ConfigError(f"--max-wait-ms must be >= 0, got {self.max_wait_ms}")
        if not self.poll_s > 0:
            raise ConfigError(f"--poll-s must be > 0, got {self.poll_s}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if not 0 <= self.shutdown_grace_s <= 3600:
            raise ConfigError(f"--shutdown-grace-s must lie in [0, 3600] seconds, got {self.shutdown_grace_s}")
        if self.source.endswith(".onnx") and (self.watch or self.best):
            raise ConfigError(f"{self.source} is an ONNX file; --watch and --best follow a run, so pass its run dir")
