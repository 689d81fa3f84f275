"""The OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``), validated into decoding settings,
and the OpenAI error shape (``{"error": {"message", "type", "param", "code"}}``) every refusal answers with.

Validation is strict, so nothing a client sends reaches a 500 or is silently ignored: booleans and integers must be
JSON booleans and integers (``"stream": "yes"`` is refused), every string must be valid Unicode (a lone UTF-16
surrogate such as ``"\\ud800"`` is refused before any tokenizer sees it), a parameter of OpenAI's API this server
does not implement is refused unless it has its "off" value (:data:`UNSUPPORTED`), and an unknown parameter is
refused (as OpenAI's own API does)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from crosstrain.generation.config import GenerationConfig

#: OpenAI's default ``max_tokens`` for /v1/completions (chat defaults to the rest of the context)
DEFAULT_MAX_TOKENS = 16
#: ``stop`` bounds: OpenAI takes up to 4 strings, vLLM any number; lm-eval's tasks can send more than 4, and each
#: string is matched after every token, so 16 strings of up to 256 characters keep one request's matching cheap
MAX_STOPS, MAX_STOP_CHARS = 16, 256
#: the most alternatives ``logprobs``/``top_logprobs`` may ask per token (vLLM's default ``max_logprobs``; OpenAI
#: takes 5 on completions and 20 on chat)
MAX_LOGPROBS = 20
#: OpenAI/vLLM parameters this server does not implement, with the values that mean "off" (accepted as such)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "logit_bias": ({},), "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "parallel_tool_calls": (), "response_format": ({"type": "text"},),
    "stream_options": (), "min_p": (0,), "min_tokens": (0,), "stop_token_ids": ([],), "ignore_eos": (False,),
    "prediction": (), "audio": (), "modalities": (["text"],), "reasoning_effort": (),
}


class APIError(Exception):
    """A refused request: HTTP ``status`` with the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Sampling(BaseModel):
    """The fields both endpoints share. ``temperature`` 0 is greedy; ``top_k`` 0 or -1 is off (vLLM's extension).
    ``user`` only names the end user (OpenAI's abuse monitoring): accepted and not used."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)  # torch.Generator.manual_seed takes 64 bits
    stop: str | list[str] | None = None
    stream: bool = False
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each")
        return value

    @model_validator(mode="after")
    def _logprobs_not_streamed(self) -> Sampling:
        if self.stream and self.alternatives() is not None:
            raise ValueError("logprobs are not streamed by this server; send logprobs without stream")
        return self

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    def alternatives(self) -> int | None:
        """Top alternatives to report per token (None: no log-probs asked)."""
        return None

    def score_prompt(self) -> bool:
        """Whether the prompt's tokens are scored too (completions' ``echo`` with ``logprobs``)."""
        return False

    def generation(self, max_new_tokens: int, stop_tokens: tuple[int, ...]) -> GenerationConfig:
        greedy = self.temperature == 0
        return GenerationConfig(max_new_tokens=max_new_tokens, greedy=greedy,
                                temperature=1.0 if greedy else self.temperature, top_k=max(self.top_k, 0),
                                top_p=self.top_p, stop_tokens=stop_tokens)


class CompletionBody(Sampling):
    """``logprobs``: the legacy int (that many alternatives per token, plus the chosen one); ``echo``: the reply
    starts with the prompt, and with ``logprobs`` scores each prompt token (the first one has none)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _echo_not_streamed(self) -> CompletionBody:
        if self.echo and self.stream:
            raise ValueError("echo is not streamed; send echo without stream")
        return self

    def alternatives(self) -> int | None:
        return self.logprobs

    def score_prompt(self) -> bool:
        return self.echo and self.logprobs is not None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class Message(BaseModel):
    """A chat message; ``content`` as a string or a list of text parts (joined with newlines, as vLLM does)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: str
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else []:
            if isinstance(part, dict) and part.get("type") != "text":
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}; send "
                                 "{\"type\": \"text\", \"text\": ...} parts")
            if not (isinstance(part, dict) and isinstance(part.get("text"), str) and set(part) == {"type", "text"}):
                raise ValueError("a content part is {\"type\": \"text\", \"text\": \"...\"}, got "
                                 f"{json.dumps(part)[:60]}")
        return value

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class ChatBody(Sampling):
    """``max_completion_tokens`` is OpenAI's newer name for ``max_tokens``; ``logprobs`` + ``top_logprobs``: the
    chosen token's log-prob and that many alternatives per token."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _one_budget(self) -> ChatBody:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens differ; send one of them")
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) in ``value`` that is not valid Unicode, if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}.{key}" if path else str(key)
        found = _lone_surrogate(key, where) if isinstance(key, str) else None
        if found := found or _lone_surrogate(item, where):
            return found
    return None


def _refuse_unsupported(data: dict[str, Any], kind: type[BaseModel], endpoint: str) -> dict[str, Any]:
    """``data`` without the unimplemented parameters sent at their "off" value; an APIError for any other."""
    kept = {}
    for key, value in data.items():
        if key in kind.model_fields:
            kept[key] = value
            continue
        if key in UNSUPPORTED:
            offs = UNSUPPORTED[key]
            if value is None or any(value == off and isinstance(value, bool) == isinstance(off, bool) for off in offs):
                continue
            raise APIError(400, f"{key}={json.dumps(value)[:60]} is not supported by this server; leave {key} out",
                           param=key, code="unsupported_parameter")
        raise APIError(400, f"unknown parameter {key!r} for {endpoint}; this server takes "
                       f"{', '.join(kind.model_fields)}", param=key, code="unknown_parameter")
    return kept


def parse(raw: bytes, kind: type[BaseModel], endpoint: str = "this endpoint") -> Any:
    """The request body as ``kind``, or an :class:`APIError` (400) naming the first problem."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc}); send a JSON object") from exc
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    bad = _lone_surrogate(data)
    if bad is not None:
        raise APIError(400, f"{bad}: a lone UTF-16 surrogate is not valid Unicode; send well-formed text",
                       param=bad.split(".")[0])
    data = _refuse_unsupported(data, kind, endpoint)
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param.split(".")[0] if param else None) \
            from exc
