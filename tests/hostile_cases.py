"""Named hostile requests, each with the 4xx it must get (issue 57's attack, as a table).

Every numeric field with every kind of hostile number, a lone UTF-16 surrogate in every string field, deep
nesting, huge integers and arrays, empty and missing fields, bad roles, bad tool schemas, bad logit_bias keys,
unknown fields, oversized bodies, wrong content types, invalid UTF-8, truncated or non-standard JSON, wrong
methods and routes. Bodies are raw bytes, as a client may send them (Python's json cannot write most of these).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

BODY_LIMIT = 1024 * 1024  # configs/tiny.yaml's max_request_body_bytes


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes | None  # None: no body
    status: int
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def raw(obj) -> bytes:
    """JSON as a hostile client writes it: NaN / Infinity allowed, non-ASCII escaped (lone surrogates included)."""
    return json.dumps(obj, allow_nan=True).encode()


def chat(**kw) -> bytes:
    return raw({"messages": USER, "max_tokens": 4} | kw)


def completion(**kw) -> bytes:
    return raw({"prompt": "hi", "max_tokens": 4} | kw)


def _numeric() -> list[Case]:
    """Every numeric request field x every hostile kind of number (and a string / bool where a number goes)."""
    nan, inf = float("nan"), float("inf")
    values = {"huge": 2**80, "negative-huge": -2**80, "nan": nan, "inf": inf, "negative-inf": -inf, "string": "1",
              "bool": True, "object": {"value": 1}}
    completion_fields = ["max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "presence_penalty",
                         "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "n", "best_of"]
    chat_fields = ["max_completion_tokens", "top_logprobs"]
    out = []
    for name in completion_fields + chat_fields:
        for kind, v in values.items():
            if (kind == "bool" and name == "logprobs") or (kind == "huge" and name == "repetition_penalty"):
                continue  # valid: completions' logprobs is a bool or an int; repetition_penalty has no upper bound
            body = chat(**{name: v}, logprobs=True) if name == "top_logprobs" else \
                chat(**{name: v}) if name in chat_fields else completion(**{name: v})
            out.append(Case(f"{name}-{kind}", CHAT if name in chat_fields else COMPLETIONS, body, 400))
    for name in ("max_tokens", "top_k", "seed", "min_tokens"):  # integers only: a float is refused, not truncated
        out.append(Case(f"{name}-fraction", COMPLETIONS, completion(**{name: 1.5}), 400))
    out += [
        Case("logit-bias-value-nan", COMPLETIONS, completion(logit_bias={"1": float("nan")}), 400),
        Case("logit-bias-value-inf", COMPLETIONS, completion(logit_bias={"1": float("inf")}), 400),
        Case("logit-bias-value-101", COMPLETIONS, completion(logit_bias={"1": 101}), 400),
        Case("logit-bias-value-string", COMPLETIONS, completion(logit_bias={"1": "up"}), 400),
        Case("stop-token-id-negative", COMPLETIONS, completion(stop_token_ids=[-1]), 400),
        Case("stop-token-id-huge", COMPLETIONS, completion(stop_token_ids=[2**80]), 400),
        Case("stop-token-id-past-int32", COMPLETIONS, completion(stop_token_ids=[2**40]), 400),
        # min_tokens masks stop ids in the logits: one past the vocabulary used to fail its whole step
        Case("stop-token-id-past-vocab-min-tokens", COMPLETIONS, completion(stop_token_ids=[100000], min_tokens=2), 400),
        Case("stop-token-id-huge-min-tokens", COMPLETIONS, completion(stop_token_ids=[2**70], min_tokens=2), 400),
        Case("logit-bias-key-past-vocab-sampled", COMPLETIONS, completion(logit_bias={"100000": 5}, temperature=1.0),
             400),
        Case("prompt-token-nan", COMPLETIONS, raw({"prompt": [1, float("nan")], "max_tokens": 4}), 400),
        Case("prompt-token-float", COMPLETIONS, raw({"prompt": [1, 2.5], "max_tokens": 4}), 400),
        Case("prompt-token-huge", COMPLETIONS, raw({"prompt": [2**80], "max_tokens": 4}), 400),
        Case("prompt-token-past-vocab", COMPLETIONS, raw({"prompt": [2**31], "max_tokens": 4}), 400),
        Case("detokenize-token-negative", "/detokenize", raw({"tokens": [-1]}), 400),
        Case("detokenize-token-huge", "/detokenize", raw({"tokens": [2**80]}), 400),
        Case("detokenize-token-past-vocab", "/detokenize", raw({"tokens": [2**40]}), 400),
        Case("detokenize-token-nan", "/detokenize", raw({"tokens": [float("nan")]}), 400),
    ]
    return out


S = "\ud800"  # a lone high surrogate: legal JSON (`"\ud800"`), not encodable text


def _surrogates() -> list[Case]:
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    with_tool = lambda f: [{"type": "function", "function": tool["function"] | f}]
    cases = {
        "prompt": (COMPLETIONS, completion(prompt=S)),
        "prompt-list-item": (COMPLETIONS, completion(prompt=["ok", "a" + S])),
        "model": (COMPLETIONS, completion(model=S)),
        "stop-string": (COMPLETIONS, completion(stop=S)),
        "stop-list-item": (COMPLETIONS, completion(stop=["x", S])),
        "user": (COMPLETIONS, completion(user=S)),
        "suffix": (COMPLETIONS, completion(suffix=S)),
        "chat-content": (CHAT, chat(messages=[{"role": "user", "content": S}])),
        "chat-content-part": (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": S}]}])),
        "chat-name": (CHAT, chat(messages=[{"role": "user", "content": "hi", "name": S}])),
        "chat-reasoning": (CHAT, chat(messages=USER + [{"role": "assistant", "content": "a", "reasoning": S}])),
        "tool-call-id": (CHAT, chat(messages=USER + [{"role": "tool", "content": "1", "tool_call_id": S}])),
        "tool-call-arguments": (CHAT, chat(messages=USER + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": S}}]}])),
        "tool-name": (CHAT, chat(tools=with_tool({"name": S}))),
        "tool-description": (CHAT, chat(tools=with_tool({"description": S}))),
        "tool-parameters-key": (CHAT, chat(tools=with_tool({"parameters": {"type": "object", S: 1}}))),
        "tool-parameters-value": (CHAT, chat(tools=with_tool({"parameters": {"type": S}}))),
        "tool-choice-name": (CHAT, chat(tools=[tool], tool_choice={"type": "function", "function": {"name": S}})),
        "reasoning-effort": (CHAT, chat(reasoning_effort=S)),
        "logit-bias-key": (COMPLETIONS, completion(logit_bias={S: 1})),
        "unknown-key": (COMPLETIONS, completion(**{S: 1})),
        "tokenize-prompt": ("/tokenize", raw({"prompt": S})),
        "tokenize-message": ("/tokenize", raw({"messages": [{"role": "user", "content": S}]})),
        "low-surrogate-alone": (COMPLETIONS, completion(prompt="\udfff")),
        "surrogates-reversed": (COMPLETIONS, completion(prompt="\udc00\ud800")),
    }
    return [Case(f"surrogate-{k}", path, body, 400) for k, (path, body) in cases.items()]


def _shapes() -> list[Case]:
    """Deep nesting, huge integers, huge arrays: bounded before parsing or refused by name."""
    deep = lambda n: b"[" * n + b"]" * n
    many_ids = raw({"prompt": list(range(100)) * 1500, "max_tokens": 4})  # ~560 KB, 150k tokens > max_model_len
    return [
        Case("nested-65-in-unknown-field", COMPLETIONS, b'{"prompt": "a", "x": ' + deep(65) + b"}", 400),
        Case("nested-50000-in-prompt", COMPLETIONS, b'{"prompt": ' + deep(50000) + b"}", 400),
        Case("nested-objects-10000", COMPLETIONS, b'{"prompt": "a", "x": ' + b'{"a":' * 10000 + b"1" + b"}" * 10000
             + b"}", 400),
        Case("nested-in-message-content", CHAT, b'{"messages": [{"role": "user", "content": ' + deep(200) + b"}]}",
             400),
        Case("nested-unclosed-100000", COMPLETIONS, b"[" * 100000, 400),
        Case("integer-65-digits", COMPLETIONS, b'{"prompt": "a", "max_tokens": 1' + b"0" * 64 + b"}", 400),
        Case("integer-5000-digits", COMPLETIONS, b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", 400),
        Case("integer-huge-negative", COMPLETIONS, b'{"prompt": "a", "top_k": -' + b"9" * 300 + b"}", 400),
        Case("float-huge-exponent", COMPLETIONS, b'{"prompt": "a", "temperature": 1e999999}', 400),
        Case("float-tiny-exponent-top-p", COMPLETIONS, b'{"prompt": "a", "top_p": 1e-999999}', 400),
        Case("float-400-digit-mantissa", COMPLETIONS, b'{"prompt": "a", "temperature": 0.' + b"1" * 400 + b"}", 400),
        Case("token-ids-150000", COMPLETIONS, many_ids, 400),
        Case("prompts-65", COMPLETIONS, completion(prompt=["a"] * 65), 400),
        Case("prompts-10000-empty-lists", COMPLETIONS, completion(prompt=[[]] * 10000), 400),
        Case("stops-1000", COMPLETIONS, completion(stop=["x"] * 1000), 400),
        Case("messages-20000", CHAT, chat(messages=USER * 20000), 400),
        Case("stop-token-ids-60000", COMPLETIONS, completion(stop_token_ids=[2**40] * 60000), 400),
        Case("logit-bias-50000-keys", COMPLETIONS, completion(logit_bias={str(i): 1 for i in range(50000)}), 400),
        Case("tools-5000", CHAT, chat(tools=[{"type": "function", "function": {"name": f"f{i}"}}
                                             for i in range(5000)]), 400),
        Case("content-parts-20000", CHAT, chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "ab"}] * 20000}]), 400),
        Case("detokenize-tokens-400000", "/detokenize", raw({"tokens": [1] * 400000}), 413),
    ]


def _missing_and_empty() -> list[Case]:
    return [
        Case("empty-body", COMPLETIONS, b"", 400),
        Case("empty-object-completion", COMPLETIONS, b"{}", 400),
        Case("empty-object-chat", CHAT, b"{}", 400),
        Case("prompt-empty-string", COMPLETIONS, completion(prompt=""), 400),
        Case("prompt-empty-list", COMPLETIONS, completion(prompt=[]), 400),
        Case("prompt-null", COMPLETIONS, completion(prompt=None), 400),
        Case("messages-empty", CHAT, chat(messages=[]), 400),
        Case("messages-null", CHAT, chat(messages=None), 400),
        Case("message-empty-object", CHAT, chat(messages=[{}]), 400),
        Case("message-without-role", CHAT, chat(messages=[{"content": "hi"}]), 400),
        Case("content-part-without-text", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400),
        Case("stop-empty-string", COMPLETIONS, completion(stop=""), 400),
        Case("tokenize-neither", "/tokenize", b"{}", 400),
        Case("tokenize-both", "/tokenize", raw({"prompt": "a", "messages": USER}), 400),
        Case("detokenize-no-tokens", "/detokenize", b"{}", 400),
        Case("whitespace-body", COMPLETIONS, b" \n\t ", 400),
    ]


def _types() -> list[Case]:
    return [
        Case("body-array", COMPLETIONS, b'[{"prompt": "a"}]', 400),
        Case("body-string", COMPLETIONS, b'"prompt"', 400),
        Case("body-number", CHAT, b"42", 400),
        Case("body-null", CHAT, b"null", 400),
        Case("body-true", COMPLETIONS, b"true", 400),
        Case("prompt-number", COMPLETIONS, completion(prompt=5), 400),
        Case("prompt-object", COMPLETIONS, completion(prompt={"text": "a"}), 400),
        Case("prompt-mixed-list", COMPLETIONS, completion(prompt=["a", 1]), 400),
        Case("messages-object", CHAT, chat(messages={"role": "user", "content": "hi"}), 400),
        Case("messages-string", CHAT, chat(messages="hi"), 400),
        Case("content-number", CHAT, chat(messages=[{"role": "user", "content": 7}]), 400),
        Case("content-object", CHAT, chat(messages=[{"role": "user", "content": {"text": "hi"}}]), 400),
        Case("content-part-image", CHAT, chat(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400),
        Case("model-number", COMPLETIONS, completion(model=1), 400),
        Case("stream-string", COMPLETIONS, completion(stream="true"), 400),
        Case("stream-number", COMPLETIONS, completion(stream=1), 400),
        Case("stream-options-string", COMPLETIONS, completion(stream=True, stream_options="usage"), 400),
        Case("stop-number", COMPLETIONS, completion(stop=5), 400),
        Case("stop-nested-list", COMPLETIONS, completion(stop=[["a"]]), 400),
        Case("ignore-eos-string", COMPLETIONS, completion(ignore_eos="no"), 400),
        Case("logit-bias-list", COMPLETIONS, completion(logit_bias=[1, 2]), 400),
        Case("stop-token-ids-strings", COMPLETIONS, completion(stop_token_ids=["1"]), 400),
        Case("user-number", COMPLETIONS, completion(user=12), 400),
        Case("tokenize-prompt-number", "/tokenize", raw({"prompt": 3}), 400),
        Case("detokenize-tokens-string", "/detokenize", raw({"tokens": "1 2 3"}), 400),
        Case("detokenize-tokens-nested", "/detokenize", raw({"tokens": [[1]]}), 400),
    ]


def _roles() -> list[Case]:
    role = lambda r: chat(messages=[{"role": r, "content": "hi"}])
    return [
        Case("role-wizard", CHAT, role("wizard"), 400),
        Case("role-empty", CHAT, role(""), 400),
        Case("role-null", CHAT, role(None), 400),
        Case("role-number", CHAT, role(3), 400),
        Case("role-uppercase", CHAT, role("USER"), 400),
        Case("role-function", CHAT, role("function"), 400),
        Case("role-list", CHAT, role(["user"]), 400),
        Case("role-tool-without-call-id", CHAT, role("tool"), 400),
        Case("user-with-tool-calls", CHAT, chat(messages=[{"role": "user", "content": "hi", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400),
        Case("message-refusal", CHAT, chat(messages=USER + [{"role": "assistant", "content": "a", "refusal": "no"}]), 400),
    ]


def _tools() -> list[Case]:
    fn = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    tools = lambda t: chat(tools=t)
    return [
        Case("tools-object", CHAT, tools({"type": "function", "function": fn}), 400),
        Case("tools-string", CHAT, tools("get_weather"), 400),
        Case("tool-type-retrieval", CHAT, tools([{"type": "retrieval", "function": fn}]), 400),
        Case("tool-without-function", CHAT, tools([{"type": "function"}]), 400),
        Case("tool-function-without-name", CHAT, tools([{"type": "function", "function": {"parameters": {}}}]), 400),
        Case("tool-name-with-spaces", CHAT, tools([{"type": "function", "function": {"name": "get weather"}}]), 400),
        Case("tool-name-65-chars", CHAT, tools([{"type": "function", "function": {"name": "f" * 65}}]), 400),
        Case("tool-name-empty", CHAT, tools([{"type": "function", "function": {"name": ""}}]), 400),
        Case("tool-name-markup", CHAT, tools([{"type": "function", "function": {"name": "f<|call|>"}}]), 400),
        Case("tool-parameters-string", CHAT, tools([{"type": "function", "function": fn | {"parameters": "{}"}}]),
             400),
        Case("tool-parameters-list", CHAT, tools([{"type": "function", "function": fn | {"parameters": []}}]), 400),
        Case("tool-strict", CHAT, tools([{"type": "function", "function": fn | {"strict": True}}]), 400),
        Case("tool-unknown-key", CHAT, tools([{"type": "function", "function": fn | {"returns": "x"}}]), 400),
        Case("tool-choice-sometimes", CHAT, chat(tools=[{"type": "function", "function": fn}],
                                                 tool_choice="sometimes"), 400),
        Case("tool-choice-unknown-function", CHAT, chat(tools=[{"type": "function", "function": fn}], tool_choice={
            "type": "function", "function": {"name": "launch"}}), 400),
        Case("tool-choice-without-tools", CHAT, chat(tool_choice={"type": "function", "function": {"name": "f"}}),
             400),
        Case("tool-call-arguments-object", CHAT, chat(messages=USER + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]), 400),
        Case("tool-call-without-function", CHAT, chat(messages=USER + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function"}]}]), 400),
        Case("functions-deprecated", CHAT, chat(functions=[fn]), 400),
    ]


def _logit_bias_keys() -> list[Case]:
    keys = {"word": "abc", "negative": "-1", "fraction": "1.5", "empty": "", "spaced": " 1", "hex": "0x1",
            "past-vocab": "99999999", "past-int64": "9" * 30, "unicode-digits": "\u0661\u0662"}
    return [Case(f"logit-bias-key-{k}", COMPLETIONS, completion(logit_bias={v: 1}), 400) for k, v in keys.items()]


def _unknown_fields() -> list[Case]:
    return [
        Case("unknown-top-level", COMPLETIONS, completion(temprature=0.5), 400),
        Case("unknown-in-message", CHAT, chat(messages=[{"role": "user", "content": "hi", "mood": "sad"}]), 400),
        Case("unknown-in-tokenize", "/tokenize", raw({"prompt": "a", "truncate": True}), 400),
        Case("n-past-64", CHAT, chat(n=65), 400),
        Case("refused-response-format", CHAT, chat(response_format={"type": "json_object"}), 400),
        Case("refused-guided-json", COMPLETIONS, completion(guided_json={"type": "object"}), 400),
        Case("refused-echo", COMPLETIONS, completion(echo=True), 400),
        Case("refused-suffix", COMPLETIONS, completion(suffix="end"), 400),
        Case("refused-chat-template", CHAT, chat(chat_template="{{ x }}"), 400),
        Case("refused-prompt-embeds", COMPLETIONS, completion(prompt_embeds="AAAA"), 400),
        Case("duplicate-key-bad-last", COMPLETIONS, b'{"prompt": "a", "max_tokens": 4, "max_tokens": -4}', 400),
    ]


def _bytes() -> list[Case]:
    """Oversized bodies, wrong content types, invalid UTF-8, truncated and non-standard JSON."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    return [
        Case("body-over-limit", COMPLETIONS, completion(prompt="z" * (BODY_LIMIT + 1)), 413),
        Case("body-10-mib", COMPLETIONS, b'{"prompt": "' + b"z" * (10 * BODY_LIMIT) + b'"}', 413),
        Case("content-type-form", COMPLETIONS, b"prompt=hi&max_tokens=4", 400, headers=form),
        Case("content-type-multipart", COMPLETIONS, b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi'
             b"\r\n--b--\r\n", 400, headers={"content-type": "multipart/form-data; boundary=b"}),
        Case("content-type-xml", COMPLETIONS, b"<prompt>hi</prompt>", 400, headers={"content-type": "application/xml"}),
        Case("content-type-text-bad-field", COMPLETIONS, completion(top_k=2**80), 400,
             headers={"content-type": "text/plain"}),
        Case("content-type-none", COMPLETIONS, b"prompt", 400, headers={}),
        Case("utf8-invalid-byte", COMPLETIONS, b'{"prompt": "a\xff"}', 400),
        Case("utf8-overlong-slash", COMPLETIONS, b'{"prompt": "a\xc0\xaf"}', 400),
        Case("utf8-truncated-sequence", COMPLETIONS, b'{"prompt": "\xe2\x82"}', 400),
        Case("utf8-encoded-surrogate", COMPLETIONS, b'{"prompt": "\xed\xa0\x80"}', 400),
        Case("latin1-body", COMPLETIONS, '{"prompt": "caf\xe9"}'.encode("latin-1"), 400),
        Case("utf16-body", COMPLETIONS, '{"prompt": "hi"'.encode("utf-16"), 400),
        Case("utf8-bom-then-junk", COMPLETIONS, b"\xef\xbb\xbf{", 400),
        Case("truncated-after-brace", COMPLETIONS, b"{", 400),
        Case("truncated-after-key", COMPLETIONS, b'{"prompt"', 400),
        Case("truncated-in-string", COMPLETIONS, b'{"prompt": "a', 400),
        Case("truncated-in-number", COMPLETIONS, b'{"prompt": "a", "max_tokens": 1', 400),
        Case("truncated-in-messages", CHAT, b'{"messages": [{"role": "user"', 400),
        Case("truncated-escape", COMPLETIONS, b'{"prompt": "\\u12', 400),
        Case("trailing-garbage", COMPLETIONS, b'{"prompt": "a"} x', 400),
        Case("two-objects", COMPLETIONS, b'{"prompt": "a"}{"prompt": "b"}', 400),
        Case("single-quotes", COMPLETIONS, b"{'prompt': 'a'}", 400),
        Case("trailing-comma", COMPLETIONS, b'{"prompt": "a",}', 400),
        Case("comment", COMPLETIONS, b'{"prompt": "a" /* hi */}', 400),
        Case("python-literals", COMPLETIONS, b'{"prompt": "a", "stream": True}', 400),
        Case("raw-control-char", COMPLETIONS, b'{"prompt": "a\x00b"}', 400),
        Case("bad-escape", COMPLETIONS, b'{"prompt": "\\x41"}', 400),
        Case("unquoted-key", COMPLETIONS, b'{prompt: "a"}', 400),
    ]


def _routes() -> list[Case]:
    return [
        Case("get-completions", COMPLETIONS, None, 405, method="GET", headers={}),
        Case("put-chat", CHAT, chat(), 405, method="PUT"),
        Case("delete-models", "/v1/models", None, 405, method="DELETE", headers={}),
        Case("unknown-route", "/v1/engines/tiny/completions", completion(), 404),
        Case("path-traversal", "/v1/../../etc/passwd", None, 404, method="GET", headers={}),
        Case("model-card-surrogate-escape", "/v1/models/%ED%A0%80", None, 404, method="GET", headers={}),
        Case("model-card-nul", "/v1/models/%00", None, 404, method="GET", headers={}),
        Case("path-8000-chars", "/v1/" + "a" * 8000, None, 404, method="GET", headers={}),
    ]


CASES: list[Case] = (_numeric() + _surrogates() + _shapes() + _missing_and_empty() + _types() + _roles() + _tools()
                     + _logit_bias_keys() + _unknown_fields() + _bytes() + _routes())
assert len({c.name for c in CASES}) == len(CASES), "case names are unique"
