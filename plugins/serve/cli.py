"""``crosstrain serve``."""

from __future__ import annotations

import argparse


def run_serve(args: argparse.Namespace) -> int:
    import importlib.util

    from crosstrain.errors import ConfigError
    from crosstrain.plugins.serve.config import ServeOptions

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"crosstrain serve needs {', '.join(missing)}; install them with: "
                          "pip install 'crosstrain[serve]'")
    options = ServeOptions(source=args.source, host=args.host, port=args.port, engine=args.engine,
                           watch=args.watch, best=args.best, max_batch=args.max_batch,
                           max_wait_ms=args.max_wait_ms, poll_s=args.poll_s, model_name=args.model_name,
                           threads=args.threads, shutdown_grace_s=args.shutdown_grace_s)
    from crosstrain.plugins.vision.load import run_recipe

    if run_recipe(args.source) is not None:  # a classify or detect run: the image endpoints
        from crosstrain.plugins.vision.serve import serve_images

        return serve_images(options)
    from crosstrain.plugins.serve.server import main

    return main(options)


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (hot update with --watch)",
                       description="Serve a run dir (newest verified checkpoint), a checkpoint, a .safetensors file, "
                                   "a Hugging Face folder or an exported .onnx over OpenAI's /v1/completions and "
                                   "/v1/chat/completions, with continuous batching. --watch swaps in each newer "
                                   "checkpoint of the run once it passes the parity gate.")
    p.add_argument("source", metavar="SOURCE", help="what `crosstrain generate` takes")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (printed at startup)")
    p.add_argument("--engine", choices=("torch", "onnxruntime"), default=None,
                   help="default: onnxruntime for .onnx files, torch otherwise")
    p.add_argument("--watch", action="store_true", help="serve each newer verified checkpoint of the run")
    p.add_argument("--best", action="store_true", help="serve the run's best checkpoint (with --watch: each new best)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences sharing one decode step")
    p.add_argument("--max-wait-ms", type=float, default=5.0,
                   help="an idle server waits this long for more requests before starting a batch")
    p.add_argument("--poll-s", type=float, default=2.0, help="--watch: seconds between looks at the run dir")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the run dir's name)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--shutdown-grace-s", type=float, default=10.0,
                   help="on SIGTERM/SIGINT: stop accepting, let replies in flight finish for this many seconds, then "
                        "end the rest (streams: an error event, then [DONE]) and exit 0")
    p.set_defaults(func=_dispatch)


def _dispatch(args: argparse.Namespace) -> int:
    if args.engine is None:
        args.engine = "onnxruntime" if str(args.source).endswith(".onnx") else "torch"
    return run_serve(args)
