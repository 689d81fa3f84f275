"""The OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``), validated into decoding settings,
and the OpenAI error shape (``{"error": {"message", "type", "param", "code"}}``) every refusal answers with."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from crosstrain.generation.config import GenerationConfig

#: OpenAI's default ``max_tokens`` for /v1/completions (chat defaults to the rest of the context)
DEFAULT_MAX_TOKENS = 16


class APIError(Exception):
    """A refused request: HTTP ``status`` with the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Sampling(BaseModel):
    """The fields both endpoints share. ``temperature`` 0 is greedy; ``top_k`` 0 or -1 is off (vLLM's extension)."""

    model_config = ConfigDict(extra="allow")  # clients send fields this server ignores (user, logit_bias, ...)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported; prepend the prompt yourself")
        return value

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    def generation(self, max_new_tokens: int, stop_tokens: tuple[int, ...]) -> GenerationConfig:
        greedy = self.temperature == 0
        return GenerationConfig(max_new_tokens=max_new_tokens, greedy=greedy,
                                temperature=1.0 if greedy else self.temperature, top_k=max(self.top_k, 0),
                                top_p=self.top_p, stop_tokens=stop_tokens)


class CompletionBody(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]


class Message(BaseModel):
    role: str
    content: str


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)


def parse(raw: bytes, kind: type[BaseModel]) -> Any:
    """The request body as ``kind``, or an :class:`APIError` (400) naming the first problem."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc}); send a JSON object") from exc
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from exc
