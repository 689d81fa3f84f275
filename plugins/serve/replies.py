"""The reply side of the API: waiting on a job's events, OpenAI's completion bodies, server-sent event streams
(one chunk per text delta, a last chunk with ``finish_reason``, then ``[DONE]``) and the per-request metrics."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse

from crosstrain.plugins.serve.logprobs import completion_logprobs
from crosstrain.plugins.serve.protocol import APIError, CompletionBody, Sampling
from crosstrain.plugins.serve.requests import Job

if TYPE_CHECKING:
    from crosstrain.plugins.serve.app import Served


def submit(served: Served, job: Job) -> None:
    """Queue ``job``, tracked as in flight (so a shutdown can end it); once the server is shutting down past its
    grace period the job fails at once instead."""
    if served.inflight.admit(job):
        served.scheduler.submit(job)


def settle(served: Served, job: Job) -> None:
    """The reply is over (sent, failed, or its client went away): its sequence leaves the batch at the next step."""
    job.cancelled = True
    served.inflight.discard(job)


async def gather(served: Served, jobs: list[Job]) -> list[tuple[str, str, int]]:
    for job in jobs:
        submit(served, job)
    try:
        return [await result(served, job) for job in jobs]
    finally:
        for job in jobs:
            settle(served, job)


async def result(served: Served, job: Job) -> tuple[str, str, int]:
    while True:
        event = await job.events.get()
        if event[0] == "error":
            raise event_error(event)
        if event[0] == "done":
            record(served, job, event[2])
            return job.text, event[1], event[2]


def event_error(event: tuple[Any, ...]) -> APIError:
    status, message = int(event[1]), str(event[2])
    return APIError(status, message, kind="invalid_request_error" if status < 500 else "server_error")


def record(served: Served, job: Job, tokens: int) -> None:
    now = time.perf_counter()
    served.metrics.latency.observe(now - job.submitted)
    if job.first_token is not None:
        served.metrics.ttft.observe(job.first_token - job.submitted)
    served.metrics.prompt_tokens.inc(len(job.prompt))
    served.metrics.generation_tokens.inc(tokens)


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def fingerprint(job: Job) -> str | None:
    """The version that produced the reply: ``step-N`` (or ``vN``) and the first 12 hex of its params SHA-256."""
    v = job.version
    if v is None:
        return None
    return f"{'step-' + str(v.step) if v.step is not None else 'v' + str(v.number)}-{(v.params_sha256 or '')[:12]}"


def completion_body(served: Served, jobs: list[Job], results: list[tuple[str, str, int]],
                    body: CompletionBody) -> dict[str, Any]:
    """``echo``: each text starts with its prompt; ``logprobs``: each choice's log-probs (logprobs.py)."""
    choices = [{"index": i, "text": (job.decode(job.prompt) if body.echo else "") + text, "finish_reason": finish,
                "logprobs": completion_logprobs(job, body.echo) if body.logprobs is not None else None}
               for i, (job, (text, finish, _)) in enumerate(zip(jobs, results, strict=True))]
    totals = usage(sum(len(j.prompt) for j in jobs), sum(n for _, _, n in results))
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": served.name, "choices": choices, "usage": totals, "system_fingerprint": fingerprint(jobs[0])}


def stream(served: Served, job: Job, body: Sampling, kind: str) -> StreamingResponse:
    """Server-sent events: one chunk per text delta, a last chunk with ``finish_reason``, then ``[DONE]``."""
    ident = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}"
    chat = kind.startswith("chat")

    def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        data = {"id": ident, "object": kind, "created": int(time.time()), "model": served.name, "choices": [choice],
                "system_fingerprint": fingerprint(job)}
        return f"data: {json.dumps(data)}\n\n"

    async def events() -> AsyncIterator[str]:
        submit(served, job)
        try:
            first = True
            while True:
                event = await job.events.get()
                if event[0] == "delta":
                    yield chunk(event[1], None, first)
                    first = False
                elif event[0] == "done":
                    record(served, job, event[2])
                    yield chunk(None, event[1], first)
                    break
                else:
                    yield f"data: {json.dumps(event_error(event).body())}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            settle(served, job)

    return StreamingResponse(events(), media_type="text/event-stream")
