"""OpenAI's HTTP shapes: request models, the error envelope, response bodies and stream chunks.

Request models are strict about types (a string where a number belongs is a 400, as with OpenAI)
and ignore unknown fields (OpenAI clients send fields this server does not implement, such as
`presence_penalty`); features whose silent omission would change the answer (`n > 1`,
`logprobs`) are refused by name.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from peagle_cluster import guard

# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
                503: "service_unavailable_error"}


class APIError(Exception):
    """An error a client may see: HTTP status plus OpenAI's `{"error": {...}}` fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "api_error"), "param": param,
                      "code": code if code is not None else status}}


def validation_error(e: ValidationError) -> APIError:
    """pydantic's report as a 400 naming the first bad field; never echoes Python internals."""
    errs = e.errors(include_url=False, include_context=False)
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(x) for x in first["loc"] if not str(x).startswith("function-")) or None
    msgs = []
    for err in errs[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        msg = str(err["msg"]).removeprefix("Value error, ")
        msgs.append(f"{guard.echo(loc)}: {guard.echo(msg, 300)}")  # keys may be the client's: escaped, cut
    return APIError(400, "Invalid request: " + "; ".join(msgs), param=param and guard.echo(param), code="invalid_value")


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------

# Bounds no real request reaches: the engine refuses what its model cannot do (context, vocabulary) by name.
MAX_TOKENS = 2**31 - 1
MAX_TOP_K = 2**31 - 1


class _Request(BaseModel):
    # strict: no "0.5" -> 0.5 coercion (OpenAI rejects it too); extra: OpenAI's clients send fields we ignore.
    model_config = ConfigDict(strict=True, extra="ignore", protected_namespaces=())

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-2**63, le=2**64 - 1)] | None = None  # any 64-bit seed, signed or not
    stream: bool | None = False
    stream_options: "StreamOptions | None" = None
    user: str | None = None
    logprobs: Any = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = None  # the engine also bounds it by its vocabulary
    ignore_eos: bool | None = None

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: Any) -> Any:
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported by this server")
        return None

    def sampling_kwargs(self, default_max_tokens: int | None) -> dict[str, Any]:
        """The request as `SamplingParams` keyword arguments (vLLM names); unset fields keep defaults."""
        kw: dict[str, Any] = {"max_tokens": self.requested_max_tokens() or default_max_tokens}
        for name in ("temperature", "top_p", "top_k", "seed", "ignore_eos"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        if self.stop:
            kw["stop"] = list(self.stop)
        return kw

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = False


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "input_text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)  # as the chat template joins text parts


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # harmony's system-message setting

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in self.messages]

    def char_length(self) -> int:
        return sum(len(m.text()) for m in self.messages)


class CompletionRequest(_Request):
    prompt: Any
    echo: bool | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, p: Any) -> str | list[int]:
        """One prompt: a string or a list of token ids, optionally wrapped in a one-element list."""
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            raise ValueError(f"exactly one prompt per request is supported, got {len(p)}")
        if isinstance(p, str):
            if not p:
                raise ValueError("prompt must not be empty")
            return p
        if isinstance(p, list):
            if not p:
                raise ValueError("prompt must not be empty")
            if not all(type(t) is int and t >= 0 for t in p):
                raise ValueError("a token-id prompt must be a list of non-negative integers")
            return list(p)
        raise ValueError("prompt must be a string or a list of token ids")

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        return self

    def single_prompt(self) -> str | list[int]:
        return self.prompt

    def char_length(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, str) else 0


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()


def parse_request(cls: type[_Request], raw: bytes) -> _Request:
    """Bytes -> request model, every failure as a 400 APIError (malformed JSON, too deep or long numbers,
    non-object, unencodable string, bad field)."""
    guard.check_json_shape(raw)
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"Malformed JSON body: {e.__class__.__name__} at position {getattr(e, 'pos', 0)}",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"Request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    guard.check_strings(data)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_response(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                  use: dict[str, int], reasoning: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use, "system_fingerprint": None}


def completion_response(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                        use: dict[str, int]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use, "system_fingerprint": None}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None,
               include_usage: bool) -> dict[str, Any]:
    c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
         "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if include_usage:
        c["usage"] = None  # OpenAI: null on every chunk but the last, which carries it with no choices
    return c


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     include_usage: bool) -> dict[str, Any]:
    c = {"id": rid, "object": "text_completion", "created": created, "model": model,
         "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if include_usage:
        c["usage"] = None
    return c


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict[str, int]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
