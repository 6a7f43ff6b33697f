"""OpenAI's HTTP shapes: request models, the error envelope, response bodies and stream chunks.

Request models are strict about types (a string where a number belongs is a 400, as with OpenAI).
No field is dropped silently: each declared field is honoured or refused by name unless it holds a
neutral value (`peagle_cluster.fields`), and an undeclared one is refused by name, as OpenAI does.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from peagle_cluster import guard
from peagle_cluster.fields import honoured, refusal, refused

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


def _union_tag(part: Any) -> bool:
    """pydantic's name for a union member or validator in an error's location ("bool", "constrained-int",
    "function-after[...]", "list[str]"): not part of the field's path."""
    p = str(part)
    return p in ("str", "int", "bool", "float", "list", "dict", "none") or "-" in p or "[" in p


def validation_error(e: ValidationError) -> APIError:
    """pydantic's report as a 400 naming the first bad field; never echoes Python internals."""
    errs = e.errors(include_url=False, include_context=False)
    unknown = [err for err in errs if err["type"] == "extra_forbidden"]
    if unknown:  # OpenAI's wording for a field it does not know
        where = ".".join(str(x) for x in unknown[0]["loc"])
        return APIError(400, f"Unrecognized request argument supplied: {where}", param=where,
                        code="unsupported_parameter")
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(x) for x in first["loc"] if not _union_tag(x)) or None
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
MAX_TOKEN_ID = 2**31 - 1  # then bounded by the vocabulary in the engine
MAX_PROMPTS = 64  # prompts in one completions request
MAX_CHOICES = 64  # prompts x n: engine requests one request may start
_EXACT = "exact under speculative verification (each verified position uses its own history)"
_NO_STRUCTURED = "no structured output yet"


class _Request(BaseModel):
    # strict: no "0.5" -> 0.5 coercion (OpenAI rejects it too); forbid: a field nobody declares is refused
    # by name, never dropped (fields.py; docs/cluster.md has the table of every declared field)
    model_config = ConfigDict(strict=True, extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    model: str | None = honoured("must name the served model (404 otherwise)")
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = honoured(
        "length limit (completions: default 16; chat: default the rest of the context)")
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = honoured("0 is greedy")
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = honoured("nucleus sampling")
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = honoured(
        "vLLM's: -1 disables; the engine also bounds it by its vocabulary")
    seed: Annotated[int, Field(ge=-2**63, le=2**64 - 1)] | None = honoured(
        "a per-request generator: the same seed gives the same text; any 64-bit seed, signed or not")
    stop: str | list[str] | None = honoured("at most 4 strings; the text ends before the one found (see `include_stop_str_in_output`)")
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = honoured(
        "vLLM's: extra token ids that end the completion")
    ignore_eos: bool | None = honoured("vLLM's: keep generating past end-of-turn tokens")
    stream: bool | None = honoured("server-sent events ending in `data: [DONE]`", default=False)
    stream_options: "StreamOptions | None" = honoured("`include_usage` adds the usage chunk")
    user: str | None = honoured("recorded on the request's trace span (`enduser.id`)")
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = honoured(
        f"independent samples of each prompt (choice `index` = prompt x n + sample; at most {MAX_CHOICES} "
        "choices in all); seeded: sample i is the request with `seed + i`; `usage` sums them")
    best_of: Any = refused(1, note="no ranking of samples (use `n`)")
    use_beam_search: Any = refused(False, note="no beam search")
    length_penalty: Any = refused(1, note="beam search only")
    echo: Any = refused(False, note="the prompt is not echoed")
    logprobs: bool | Annotated[int, Field(ge=0, le=20)] | None = honoured(
        "from the target's processed distribution (after temperature, top-k, top-p), drafted or not; chat: "
        "`true`, completions: the number of most likely tokens to add (<= 20)")
    prompt_logprobs: Any = refused(0, note="prompt log-probabilities are not returned")
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = honoured(_EXACT + "; on the output so far")
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = honoured(_EXACT + "; on the output so far")
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = honoured(_EXACT + "; vLLM's, on prompt and output")
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = honoured(_EXACT + "; vLLM's")
    min_tokens: Annotated[int, Field(ge=0)] | None = honoured(
        _EXACT + "; vLLM's: end-of-turn tokens, `stop_token_ids` and stop strings are held back until then (a stop "
        "string that ends after the first `min_tokens` tokens counts)")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = honoured(
        _EXACT + "; token id (a string, as OpenAI writes it) -> bias in [-100, 100]")
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = honoured(
        _EXACT + "; vLLM's: only these token ids may be sampled (non-empty, within the vocabulary)")
    bad_words: list[str] | None = honoured(
        _EXACT + "; vLLM's: a word's last token is banned where the output ends in its other tokens (each word "
        "as written and after a space)")
    logits_processors: Any = refused([], note="no custom logits processors")
    response_format: Any = refused({"type": "text"}, note=_NO_STRUCTURED)
    structured_outputs: Any = refused(note=_NO_STRUCTURED)
    guided_json: Any = refused(note=_NO_STRUCTURED)
    guided_regex: Any = refused(note=_NO_STRUCTURED)
    guided_choice: Any = refused(note=_NO_STRUCTURED)
    guided_grammar: Any = refused(note=_NO_STRUCTURED)
    guided_decoding_backend: Any = refused(note=_NO_STRUCTURED)
    guided_whitespace_pattern: Any = refused(note=_NO_STRUCTURED)
    structural_tag: Any = refused(note=_NO_STRUCTURED)
    include_stop_str_in_output: bool | None = honoured("vLLM's: the stop string that ended the text stays in it")
    skip_special_tokens: bool | None = honoured(
        "vLLM's: `false` keeps special tokens (harmony's markers) in completions' text; chat's reply is split by "
        "them, so chat refuses `false`")
    spaces_between_special_tokens: Any = refused(True, note="GPT-OSS's byte-level tokens decode without spaces")
    add_special_tokens: bool | None = honoured("accepted either way: GPT-OSS's tokenizer adds no special tokens")
    truncate_prompt_tokens: Any = refused(note="prompts are never truncated: too long is a 400")
    priority: Any = refused(0, note="one priority: first come, first served")
    request_id: Any = refused(note="the server names requests")
    return_tokens_as_token_ids: Any = refused(False, note="tokens are returned as text")
    return_token_ids: Any = refused(False, note="tokens are returned as text")
    cache_salt: Any = refused(note="the prefix cache is shared by every request (no salting yet)")
    kv_transfer_params: Any = refused(note="no disaggregated prefill")
    vllm_xargs: Any = refused({}, note="no engine extensions")
    store: Any = refused(False, note="nothing is stored")
    metadata: Any = refused({}, note="nothing is stored (metadata goes with `store`)")
    service_tier: Any = refused("auto", "default", note="one service tier")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v and not all(t.isascii() and t.isdigit() for t in v):  # "١٢" is isdigit() and int() reads it
            raise ValueError("logit_bias keys must be token ids (non-negative integers written as strings)")
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

    def num_logprobs(self) -> int | None:
        """How many most likely tokens to return besides each emitted one's; None: no log-probabilities."""
        return None if self.logprobs is None or isinstance(self.logprobs, bool) else self.logprobs

    def sampling_kwargs(self, default_max_tokens: int | None) -> dict[str, Any]:
        """The request as `SamplingParams` keyword arguments (vLLM names); unset fields keep defaults."""
        kw: dict[str, Any] = {"max_tokens": self.requested_max_tokens() or default_max_tokens}
        if (n := self.num_logprobs()) is not None:
            kw["logprobs"] = n
        for name in ("temperature", "top_p", "top_k", "seed", "ignore_eos", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_p", "min_tokens", "include_stop_str_in_output",
                     "skip_special_tokens", "n", "allowed_token_ids", "bad_words"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        if self.logit_bias:
            kw["logit_bias"] = {int(t): b for t, b in self.logit_bias.items()}
        if self.stop:
            kw["stop"] = list(self.stop)
        if self.stop_token_ids:
            kw["stop_token_ids"] = list(self.stop_token_ids)
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


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning: str | None = None  # assistant; rendered for the turn in progress (harmony drops older turns')
    reasoning_content: str | None = None  # the older name of `reasoning`
    # What the openai client sends back when a reply is appended to the history: accepted when empty
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None

    @model_validator(mode="after")
    def _roles(self) -> "ChatMessage":
        for name in ("refusal", "annotations", "audio", "function_call"):
            if getattr(self, name) not in (None, [], ""):
                raise ValueError(f"`{name}` in a message is not supported by this server")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not (self.tool_call_id or self.name):
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)  # as the chat template joins text parts

    def template_message(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id", "reasoning", "reasoning_content"):
            if getattr(self, key):
                d[key] = getattr(self, key)
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return d


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("strict")
    @classmethod
    def _strict(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("strict function schemas need structured output, which this server has not yet")
        return v


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: _FunctionName


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = honoured("rendered in harmony, GPT-OSS's chat format", min_length=1,
                                           default=...)
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = honoured("OpenAI's newer name of `max_tokens`")
    reasoning_effort: Literal["low", "medium", "high"] | None = honoured("written into harmony's system message")
    include_reasoning: bool | None = honoured("vLLM's: false leaves `reasoning` out of the reply")
    tools: list[Tool] | None = honoured("function tools, declared in harmony's developer message")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = honoured(
        "`none` hides the tools; `auto` lets the model choose; `required` and a named function start the "
        "reply with a call's header, so it is a call")
    parallel_tool_calls: bool | None = honoured("either value: GPT-OSS makes one call a turn (<|call|> ends it)")
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = honoured("with `logprobs: true`, 0 to 20")
    functions: Any = refused([], note="deprecated by OpenAI; use `tools`")
    function_call: Any = refused("none", note="deprecated by OpenAI; use `tool_choice`")
    audio: Any = refused(note="text only")
    modalities: Any = refused(["text"], note="text only")
    prediction: Any = refused(note="no predicted outputs")
    web_search_options: Any = refused(note="no web search")
    verbosity: Any = refused("medium", note="GPT-OSS has no verbosity setting")
    add_generation_prompt: Any = refused(True, note="the reply always starts a new assistant turn")
    continue_final_message: Any = refused(False, note="the reply always starts a new assistant turn")
    chat_template: Any = refused(note="GPT-OSS's harmony format is fixed")
    chat_template_kwargs: Any = refused({}, note="GPT-OSS's harmony format is fixed; use `reasoning_effort`")
    documents: Any = refused(note="no retrieval documents")
    mm_processor_kwargs: Any = refused(note="text only")

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs is True else None

    @model_validator(mode="after")
    def _special(self) -> "ChatCompletionRequest":
        if self.skip_special_tokens is False:
            raise ValueError("skip_special_tokens: false is not supported in chat (harmony's markers split the reply)")
        return self

    @model_validator(mode="after")
    def _logprobs(self) -> "ChatCompletionRequest":
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise ValueError("logprobs must be a boolean in chat (the count goes in top_logprobs)")
        if self.top_logprobs and self.logprobs is not True:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tool_choice(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        if choice == "required" and not names:
            raise ValueError("tool_choice `required` needs `tools`")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names `{choice.function.name}`, which is not in `tools`")
        return self

    def harmony_tools(self) -> list[dict[str, Any]]:
        """The functions to declare to the model: none with tool_choice `none`."""
        if self.tool_choice == "none":
            return []
        return [t.function.model_dump(exclude_none=True, exclude={"strict"}) for t in self.tools or []]

    def forced_call(self) -> tuple[bool, str | None]:
        """(whether the reply must be a call, the function it must call or None for any)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return True, self.tool_choice.function.name
        return self.tool_choice == "required", None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def char_length(self) -> int:
        return sum(len(m.text()) for m in self.messages)


class CompletionRequest(_Request):
    prompt: Any = honoured(f"a string or a list of token ids, or a list of up to {MAX_PROMPTS} of those (one "
                           "choice each, `index` in order)", default=...)
    suffix: Any = refused("", note="no fill-in-the-middle")
    prompt_embeds: Any = refused(note="token or text prompts only")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, p: Any) -> str | list[int] | tuple:
        """A string or a list of token ids; or a list of those (several prompts: a tuple, one choice each)."""
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            if len(p) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(p)}")
            return tuple(cls._prompt(x) for x in p)
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

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("logprobs must be an integer in completions (how many most likely tokens to add)")
        return v

    def prompts(self) -> list[str | list[int]]:
        return list(self.prompt) if isinstance(self.prompt, tuple) else [self.prompt]

    def single_prompt(self) -> str | list[int]:
        return self.prompt

    def char_length(self) -> int:
        """The longest string prompt's length (each prompt is its own request)."""
        return max(len(p) if isinstance(p, str) else 0 for p in self.prompts())


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a completion prompt, or chat messages rendered as chat renders them."""
    model_config = ConfigDict(strict=True, extra="forbid", protected_namespaces=())
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # GPT-OSS's tokenizer adds none either way
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self

    def replica_request(self) -> dict[str, Any]:
        d: dict[str, Any] = {"return_token_strs": self.return_token_strs}
        if self.prompt is not None:
            return d | {"kind": "completion", "prompt": self.prompt}
        d |= {"kind": "chat", "messages": [m.template_message() for m in self.messages],
              "add_generation_prompt": self.add_generation_prompt,
              "tools": [t.function.model_dump(exclude_none=True, exclude={"strict"}) for t in self.tools or []]}
        return d | ({"reasoning_effort": self.reasoning_effort} if self.reasoning_effort else {})


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", protected_namespaces=())
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()


def parse_request(cls: type[BaseModel], raw: bytes) -> BaseModel:
    """Bytes -> request model, every failure as a 400 APIError (malformed JSON, too deep or long numbers,
    non-object, unencodable string, bad field, refused field)."""
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
        req = cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    if issubclass(cls, _Request) and (refused_field := refusal(req)) is not None:
        raise APIError(400, refused_field[1], param=refused_field[0], code="unsupported_parameter")
    return req


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


def chat_choice(index: int, text: str, finish_reason: str | None, reasoning: str | None = None,
                tool_calls: list[dict[str, Any]] | None = None, logprobs: Any = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not tool_calls else None}
    if reasoning:
        message["reasoning"] = message["reasoning_content"] = reasoning  # vLLM's name, and its older one
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: Any = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_response(rid: str, model: str, created: int, choices: list[dict[str, Any]],
                  use: dict[str, int]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": use, "system_fingerprint": None}


def completion_response(rid: str, model: str, created: int, choices: list[dict[str, Any]],
                        use: dict[str, int]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": use, "system_fingerprint": None}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None,
               include_usage: bool, logprobs: Any = None, index: int = 0) -> dict[str, Any]:
    c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
         "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if include_usage:
        c["usage"] = None  # OpenAI: null on every chunk but the last, which carries it with no choices
    return c


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     include_usage: bool, logprobs: Any = None, index: int = 0) -> dict[str, Any]:
    c = {"id": rid, "object": "text_completion", "created": created, "model": model,
         "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if include_usage:
        c["usage"] = None
    return c


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI chat's `logprobs` from the replica's entries ({"token", "logprob", "bytes", "top_logprobs"})."""
    return {"content": entries}


def completion_logprobs(entries: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """OpenAI completions' (legacy) `logprobs`: parallel lists; `offset` is where these tokens' text starts."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict[str, int]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
