"""The FastAPI application: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, plus
``/health`` and ``/metrics``. Every refusal is a 4xx with OpenAI's error body; nothing a client sends makes a 500."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from crosstrain.plugins.serve import replies
from crosstrain.plugins.serve.handlers import add_error_handlers
from crosstrain.plugins.serve.logprobs import chat_logprobs
from crosstrain.plugins.serve.manager import ModelManager
from crosstrain.plugins.serve.metrics import ServeMetrics
from crosstrain.plugins.serve.protocol import DEFAULT_MAX_TOKENS, APIError, ChatBody, CompletionBody, Sampling, parse
from crosstrain.plugins.serve.requests import Job
from crosstrain.plugins.serve.scheduler import Scheduler
from crosstrain.plugins.serve.shutdown import InFlight


@dataclass
class Served:
    name: str
    manager: ModelManager
    scheduler: Scheduler
    metrics: ServeMetrics
    inflight: InFlight = field(default_factory=InFlight)  # what a shutdown ends once its grace period is over


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="crosstrain serve", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        body = APIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.middleware("http")
    async def _count(request: Request, call_next: Any) -> Response:
        response: Response = await call_next(request)
        served.metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health() -> dict[str, Any]:
        version = served.manager.current
        return {"status": "ok", "model": served.name, **version.describe(),
                "running": served.scheduler.live, "events": list(served.manager.events)[-10:]}

    @app.get("/metrics")
    async def metrics() -> Response:
        served.metrics.running.set(served.scheduler.live)
        body, content_type = served.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        version = served.manager.current
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": int(version.loaded_at),
                                            "owned_by": "crosstrain", **version.describe()}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse(await request.body(), CompletionBody, "/v1/completions")
        _check_model(served, body)
        prompts = _prompts(served, body.prompt)
        if body.stream and len(prompts) > 1:
            raise APIError(400, "stream=true takes one prompt; send one request per prompt", param="prompt")
        jobs = [_job(served, body, p, body.stops(), DEFAULT_MAX_TOKENS) for p in prompts]
        if body.stream:
            return replies.stream(served, jobs[0], body, "text_completion")
        return JSONResponse(replies.completion_body(served, jobs, await replies.gather(served, jobs), body))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        from crosstrain.plugins.serve.chat import render_chat

        body = parse(await request.body(), ChatBody, "/v1/chat/completions")
        _check_model(served, body)
        try:  # the model's own chat template when its tokenizer has one (plugins/serve/chat.py)
            text, stops = render_chat(served.manager.current.tokenizer,
                                      [{"role": m.role, "content": m.text()} for m in body.messages])
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        prompt = _prompts(served, text)[0]
        job = _job(served, body, prompt, (*body.stops(), *stops), None)
        if body.stream:
            return replies.stream(served, job, body, "chat.completion.chunk")
        (text_out, finish, n), = await replies.gather(served, [job])
        choice = {"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": text_out},
                  "logprobs": chat_logprobs(job) if body.logprobs else None}
        return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                             "created": int(time.time()), "model": served.name, "choices": [choice],
                             "usage": replies.usage(len(prompt), n),
                             "system_fingerprint": replies.fingerprint(job)})

    return app


def _check_model(served: Served, body: Sampling) -> None:
    if body.model is not None and body.model != served.name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {served.name!r} "
                       "(GET /v1/models)", param="model", code="model_not_found")


def _prompts(served: Served, prompt: Any) -> list[list[int]]:
    """Token ids of each prompt: text through the model's tokenizer, ids checked against its vocabulary."""
    from crosstrain.plugins.export.errors import ExportError

    version = served.manager.current
    rows = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    out = []
    for row in rows:
        if isinstance(row, str):
            try:
                row = version.codec.encode(row)
            except ExportError as exc:
                raise APIError(400, str(exc), param="prompt") from exc
        if not row:
            raise APIError(400, "the prompt is empty; send at least one token", param="prompt")
        if min(row) < 0 or max(row) >= version.vocab:
            raise APIError(400, f"prompt token ids must lie in [0, {version.vocab})", param="prompt")
        out.append(list(row))
    if not out:
        raise APIError(400, "the prompt is empty; send at least one token", param="prompt")
    return out


def _job(served: Served, body: Sampling, prompt: list[int], stops: tuple[str, ...], default: int | None) -> Job:
    version = served.manager.current
    room = version.context - len(prompt)
    max_tokens = body.max_tokens if body.max_tokens is not None else (default if default is not None else room)
    if room <= 0 or max_tokens > room:
        raise APIError(400, f"this model's context is {version.context} tokens; the prompt has {len(prompt)} and "
                       f"max_tokens asks {max_tokens} more; shorten the prompt or lower max_tokens",
                       param="prompt" if room <= 0 else "max_tokens", code="context_length_exceeded")
    from crosstrain.plugins.serve.chat import stop_ids

    generator = version.placement.generator(body.seed)  # on the device the batch samples on
    return Job(prompt, body.generation(max_tokens, stop_ids(version.tokenizer)), generator, stops,
               version.codec.decode, asyncio.get_running_loop(), alternatives=body.alternatives(),
               score_prompt=body.score_prompt())
