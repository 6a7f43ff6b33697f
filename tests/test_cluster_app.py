"""The router and an engine replica in-process (no Ray): protocol, errors, faults, tracing, metrics.

The replica hosts the real engine with the shipped tiny model; the router's deployment handle is
replaced by `LocalHandle`, which calls the replica object directly with the same calling shape
(`.options(stream=True).generate.remote(req)` -> async iterator with `cancel()`). All coroutines run
on one event loop in a background thread, because the engine lives on the loop that first used it.
"""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from peagle_cluster import protocol as P
from peagle_core.loading.harmony import HarmonyParser
from peagle_core.loading.tokenizer import today
from peagle_cluster.replica import EngineServer
from peagle_cluster.router import Frontend, api, install_frontend
from peagle_cluster.settings import parse_app_args
from peagle_cluster.telemetry import finished_spans

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ARGS = {"model": "tiny", "device": "cpu", "dtype": "float32", "max_num_seqs": 4, "max_model_len": 256,
        "speculative_config": {"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": 3,
                               "parallel_drafting": True},
        "api_key": KEY, "max_request_body_bytes": 16384, "tracing": {"exporter": "memory"},
        "metrics_interval_s": 0.2}


# --------------------------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------------------------

class _Method:
    def __init__(self, fn, stream: bool):
        self.fn, self.stream = fn, stream

    def remote(self, *args):
        return _LocalStream(self.fn(*args)) if self.stream else self.fn(*args)


class _LocalStream:
    def __init__(self, agen):
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self):  # Ray cancels the replica's task; closing the generator is the same to the replica
        asyncio.get_running_loop().create_task(self.agen.aclose())


class LocalHandle:
    def __init__(self, server: EngineServer, stream: bool = False):
        self.server, self.stream = server, stream

    def options(self, stream: bool = False) -> "LocalHandle":
        return LocalHandle(self.server, stream)

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.server, name), self.stream)


class Loop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def loop():
    lp = Loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def server(loop):
    settings = parse_app_args(ARGS)

    async def make():
        srv = EngineServer(settings.model_dump(), replica_id="replica-under-test")
        install_frontend(Frontend(settings, LocalHandle(srv)))
        return srv

    srv = loop.run(make())
    yield srv
    srv.shutdown()


def call(loop, method: str, path: str, body=None, headers=None, raw: bytes | None = None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://peagle") as c:
            h = dict(AUTH if headers is None else headers)
            if raw is not None:
                return await c.request(method, path, content=raw, headers=h | {"content-type": "application/json"})
            return await c.request(method, path, json=body, headers=h)
    return loop.run(go())


def sse_events(text: str) -> list:
    """Parse an SSE body; every event must be `data: ...` followed by a blank line."""
    assert text.endswith("\n\n")
    out = []
    for block in text.strip("\n").split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_envelope(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and "Traceback" not in r.text and "File \"" not in r.text
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


# --------------------------------------------------------------------------------------------
# Success paths
# --------------------------------------------------------------------------------------------

def test_completion_matches_offline_greedy_generation(loop, server):
    from peagle_core import LLM, SamplingParams

    prompt = "The quick brown fox"
    r = call(loop, "POST", "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    llm = LLM(model="tiny", device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4,
              speculative_config=ARGS["speculative_config"])
    ref = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0]
    # The serving stack changes nothing: same greedy text, same token count, same finish reason.
    assert choice["text"] == ref.outputs[0].text
    assert body["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids)
    assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert choice["finish_reason"] == ref.outputs[0].finish_reason


def test_token_id_prompts_equal_string_prompts(loop, server):
    ids = server.llm.tokenizer.encode("Hello there")
    a = call(loop, "POST", "/v1/completions", {"prompt": "Hello there", "max_tokens": 8, "temperature": 0}).json()
    b = call(loop, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0}).json()
    c = call(loop, "POST", "/v1/completions", {"prompt": [ids], "max_tokens": 8, "temperature": 0}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] == c["choices"][0]["text"]
    assert a["usage"] == b["usage"] == c["usage"]


def test_streamed_completion_concatenates_to_the_non_streamed_text(loop, server):
    req = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    whole = call(loop, "POST", "/v1/completions", req).json()
    r = call(loop, "POST", "/v1/completions", req | {"stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == ["length"]  # ignore_eos: exactly max_tokens
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert whole["usage"]["completion_tokens"] == 16
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_uses_the_harmony_template_and_streams_openai_chunks(loop, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = call(loop, "POST", "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 10,
                                                      "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    tok = server.llm.tokenizer
    expected_prompt = len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                             current_date=today())))
    assert body["usage"]["prompt_tokens"] == expected_prompt
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(body["choices"][0]["message"]["content"], str)

    r = call(loop, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 10, "temperature": 0,
                                                      "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "usage" not in chunks[0]  # only with stream_options.include_usage
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
    msg = body["choices"][0]["message"]
    assert streamed == msg["content"] and reasoning == (msg.get("reasoning_content") or "")


def test_models_health_and_unknown_fields(loop, server):
    r = call(loop, "GET", "/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["tiny"] and r.json()["data"][0]["max_model_len"] == 256
    assert call(loop, "GET", "/v1/models/tiny").json()["id"] == "tiny"
    assert call(loop, "GET", "/health", headers={}).json()["status"] == "ok"  # no key needed
    # A field at its neutral value passes; anything else is refused by name (tests/test_openai_api.py).
    r = call(loop, "POST", "/v1/completions", {"prompt": "a b", "max_tokens": 2, "best_of": 1})
    assert r.status_code == 200, r.text
    assert_envelope(call(loop, "POST", "/v1/completions", {"prompt": "a b", "best_of": 2}), 400,
                    "best_of", "unsupported_parameter")


# --------------------------------------------------------------------------------------------
# Bad input: status + OpenAI envelope, never a traceback
# --------------------------------------------------------------------------------------------

BAD = [
    # (id, path, body | raw bytes, headers, status, param, code)
    ("malformed-json", "/v1/completions", b'{"prompt": "a",', None, 400, None, "invalid_json"),
    ("not-an-object", "/v1/chat/completions", b'["hello"]', None, 400, None, "invalid_json"),
    ("not-utf8", "/v1/completions", b'\xff\xfe{}', None, 400, None, "invalid_json"),
    ("wrong-type-temperature", "/v1/completions", {"prompt": "a", "temperature": "hot"}, None, 400, "temperature", None),
    ("wrong-type-max-tokens", "/v1/completions", {"prompt": "a", "max_tokens": "10"}, None, 400, "max_tokens", None),
    ("wrong-type-stream", "/v1/completions", {"prompt": "a", "stream": "yes"}, None, 400, "stream", None),
    ("missing-messages", "/v1/chat/completions", {"model": "tiny"}, None, 400, "messages", None),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, None, 400, "messages", None),
    ("bad-role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400, None, None),
    ("missing-prompt", "/v1/completions", {"max_tokens": 3}, None, 400, "prompt", None),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, None, 400, "prompt", None),
    ("negative-token-id", "/v1/completions", {"prompt": [1, -2]}, None, 400, "prompt", None),
    ("65-prompts", "/v1/completions", {"prompt": ["a"] * 65}, None, 400, "prompt", None),
    ("temperature-too-high", "/v1/completions", {"prompt": "a", "temperature": 2.5}, None, 400, "temperature", None),
    ("negative-temperature", "/v1/completions", {"prompt": "a", "temperature": -1}, None, 400, "temperature", None),
    ("top-p-zero", "/v1/completions", {"prompt": "a", "top_p": 0}, None, 400, "top_p", None),
    ("top-k-zero", "/v1/completions", {"prompt": "a", "top_k": 0}, None, 400, "top_k", None),
    ("max-tokens-zero", "/v1/completions", {"prompt": "a", "max_tokens": 0}, None, 400, "max_tokens", None),
    ("choices-past-64", "/v1/completions", {"prompt": ["a", "b"], "n": 33}, None, 400, "n", None),
    ("logprobs-over-20", "/v1/completions", {"prompt": "a", "logprobs": 21}, None, 400, "logprobs", None),
    ("five-stops", "/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, None, 400, "stop", None),
    ("out-of-vocab-id", "/v1/completions", {"prompt": [10**9]}, None, 400, None, None),
    ("prompt-too-many-tokens", "/v1/completions", {"prompt": " ".join(map(str, range(400)))}, None, 400, "prompt",
     "context_length_exceeded"),
    ("prompt-plus-max-tokens", "/v1/completions", {"prompt": "hello " * 100, "max_tokens": 250}, None, 400,
     "max_tokens", "context_length_exceeded"),
    ("chat-too-long", "/v1/chat/completions", {"messages": [{"role": "user", "content": " ".join(map(str, range(400)))}]}, None, 400,
     "messages", "context_length_exceeded"),
    ("unknown-model", "/v1/completions", {"model": "gpt-4", "prompt": "a"}, None, 404, "model", "model_not_found"),
    ("unknown-model-card", "/v1/models/gpt-4", None, None, 404, "model", None),
    ("no-key", "/v1/completions", {"prompt": "a"}, {}, 401, None, "invalid_api_key"),
    ("wrong-key", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
     {"Authorization": "Bearer nope"}, 401, None, "invalid_api_key"),
    ("models-no-key", "/v1/models", None, {}, 401, None, None),
    ("body-too-large", "/v1/completions", {"prompt": "x" * 20000}, None, 413, None, "request_too_large"),
    ("unknown-route", "/v1/engines", None, None, 404, None, None),
    # hostile values: every number bounded, named (issue 57)
    ("top-k-past-int64", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "top_k": 2**63}, None, 400, "top_k", None),
    ("top-k-past-vocab", "/v1/completions", {"prompt": "hi", "top_k": 10**6}, None, 400, "top_k", None),
    ("seed-past-64-bits", "/v1/completions", {"prompt": "hi", "seed": 2**70}, None, 400, "seed", None),
    ("max-tokens-huge", "/v1/completions", {"prompt": "hi", "max_tokens": 2**40}, None, 400, "max_tokens", None),
    ("max-completion-tokens-huge", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                            "max_completion_tokens": 2**63}, None, 400,
     "max_completion_tokens", None),
    ("n-zero", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, None, 400, "n", None),
    ("n-huge", "/v1/completions", {"prompt": "a", "n": 2**64}, None, 400, "n", None),
    ("temperature-infinite", "/v1/completions", b'{"prompt": "a", "temperature": 1e999}', None, 400, "temperature",
     None),
    ("temperature-nan", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', None, 400, "temperature", None),
    ("huge-token-id", "/v1/completions", {"prompt": [2**64]}, None, 400, None, None),
    # strings UTF-8 cannot carry, JSON too deep or with huge numbers: 400 before any work
    ("surrogate-prompt", "/v1/completions", b'{"prompt": "\\ud800"}', None, 400, "prompt", "invalid_value"),
    ("surrogate-content", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', None,
     400, "messages.0.content", "invalid_value"),
    ("surrogate-model", "/v1/completions", b'{"model": "\\ud800", "prompt": "a"}', None, 400, "model",
     "invalid_value"),
    ("surrogate-stop", "/v1/completions", b'{"prompt": "a", "stop": ["\\udc00"]}', None, 400, "stop.0", None),
    ("surrogate-key", "/v1/completions", b'{"prompt": "a", "\\ud800": 1}', None, 400, None, "invalid_value"),
    ("nested-8000", "/v1/completions", b'{"prompt": "a", "x": ' + b"[" * 8000 + b"]" * 8000 + b"}", None, 400,
     None, "invalid_json"),
    ("integer-5000-digits", "/v1/completions", b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}", None, 400,
     None, "invalid_json"),
]


@pytest.mark.parametrize("name,path,body,headers,status,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_status_and_openai_envelope(loop, server, name, path, body, headers, status, param, code):
    if body is None:
        r = call(loop, "GET", path, headers=headers)
    elif isinstance(body, bytes):
        r = call(loop, "POST", path, raw=body, headers=headers)
    else:
        r = call(loop, "POST", path, body, headers=headers)
    err = assert_envelope(r, status, param, code)
    if status == 401:
        assert r.headers.get("www-authenticate") == "Bearer"


def test_json_depth_and_number_length_count_only_outside_strings():
    from peagle_cluster.guard import MAX_JSON_DEPTH, MAX_NUMBER_DIGITS, check_json_shape
    from peagle_cluster.protocol import APIError

    nest = lambda d: b'{"x": ' + b"[" * (d - 1) + b"]" * (d - 1) + b"}"
    check_json_shape(nest(MAX_JSON_DEPTH))
    check_json_shape(json.dumps({"p": "[{" * 500 + '\\"' + "9" * 500, "q": "\\", "r": [1.5] * 3}).encode())
    check_json_shape(b'{"n": ' + b"9" * MAX_NUMBER_DIGITS + b"}")
    for bad in (nest(MAX_JSON_DEPTH + 1), b'{"n": ' + b"9" * (MAX_NUMBER_DIGITS + 1) + b"}", b"[" * 50000,
                b'{"s": "a\\\\", "x": ' + b"[" * 100 + b"}"):  # an escaped backslash ends its string
        with pytest.raises(APIError) as e:
            check_json_shape(bad)
        assert e.value.status == 400


def test_echoed_values_are_escaped_and_cut():
    from peagle_cluster.guard import ECHO_CHARS, echo
    assert echo("\ud800" + "é" * 100) == "\\ud800" + "\\xe9" * (ECHO_CHARS - 1) + "..."
    assert echo("tiny") == "tiny"


def test_unknown_model_name_is_echoed_escaped_and_cut(loop, server):
    err = assert_envelope(call(loop, "POST", "/v1/completions", {"model": "é" * 5000, "prompt": "a"}), 404, "model")
    assert len(err["message"]) < 400 and "\\xe9" in err["message"] and err["message"].isascii()


def test_a_poisoned_request_leaves_concurrent_requests_unharmed(loop, server):
    """The issue's reproducer amid running requests: it gets a 400 naming top_k, the others their exact text."""
    good = {"prompt": "x y", "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    alone = call(loop, "POST", "/v1/completions", good).json()["choices"][0]["text"]

    async def together():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://peagle") as c:
            post = lambda body: c.post("/v1/completions", json=body, headers=AUTH)
            return await asyncio.gather(post(good), post(good | {"stream": True}), post(good), *[
                post({"prompt": "hi", "max_tokens": 4, "top_k": k}) for k in (9223372036854775808, 10**6)],
                post({"prompt": "hi", "max_tokens": 4, "seed": 2**70}))
    a, streamed, b, *poisoned = loop.run(together())
    for r, param in zip(poisoned, ("top_k", "top_k", "seed")):
        assert_envelope(r, 400, param)
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"] == alone
    assert "".join(e["choices"][0]["text"] for e in sse_events(streamed.text)[:-1] if e["choices"]) == alone
    assert _wait_idle(loop, server)["kv_blocks_used"] == 0


def test_a_stalled_body_is_a_408_in_seconds(loop, server):
    """A client that declares a body and never sends it (slowloris) is answered within body_read_timeout_s."""
    import time

    install_frontend(Frontend(server.settings.model_copy(update={"body_read_timeout_s": 0.5}), LocalHandle(server)))

    async def stalled():
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": b'{"prompt": ', "more_body": True}
            await asyncio.sleep(3600)
        out = []

        async def send(msg):
            out.append(msg)
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "scheme": "http", "server": ("peagle", 80),
                 "headers": [(b"content-length", b"1000"), (b"content-type", b"application/json"),
                             (b"authorization", AUTH["Authorization"].encode())]}
        await api(scope, receive, send)
        return out
    try:
        t0 = time.monotonic()
        out = loop.run(stalled(), timeout=30)
        took = time.monotonic() - t0
    finally:
        install_frontend(Frontend(parse_app_args(ARGS), LocalHandle(server)))
    start = next(m for m in out if m["type"] == "http.response.start")
    body = json.loads(b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body"))
    assert start["status"] == 408 and body["error"]["code"] == "request_timeout" and took < 5
    assert (b"connection", b"close") in start["headers"]


def test_wrong_method_is_an_envelope_too(loop, server):
    assert_envelope(call(loop, "GET", "/v1/completions"), 405)


def test_huge_prompt_is_refused_before_tokenising(loop, server, monkeypatch):
    calls = []
    real = server.llm.tokenizer.encode
    monkeypatch.setattr(server.llm.tokenizer, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    big = "x" * (256 * server.max_chars_per_token + 1)
    install_frontend(Frontend(server.settings.model_copy(update={"max_request_body_bytes": 10**7}),
                              LocalHandle(server)))
    try:
        err = assert_envelope(call(loop, "POST", "/v1/completions", {"prompt": big}), 400, "prompt",
                              "context_length_exceeded")
        assert "characters" in err["message"] and calls == []
    finally:
        install_frontend(Frontend(parse_app_args(ARGS), LocalHandle(server)))


# --------------------------------------------------------------------------------------------
# Faults: engine errors touch only their request; disconnects abort; shutdown ends streams cleanly
# --------------------------------------------------------------------------------------------

def _failing_generate(real, after: int):
    """Wrap llm.generate: pass `after` outputs through, then fail like a broken engine step."""
    from peagle_core.engine.async_llm import EngineError

    async def gen(prompt, params, request_id, *rest):
        agen = real(prompt, params, request_id, *rest)
        try:
            n = 0
            async for out in agen:
                if n == after:
                    raise EngineError("injected step failure")
                n += 1
                yield out
        finally:
            await agen.aclose()
    return gen


def _wait_idle(loop, server, timeout=10.0):
    async def go():
        for _ in range(int(timeout / 0.05)):
            s = server.llm.stats()
            if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_used"] == 0:
                return s
            await asyncio.sleep(0.05)
        return server.llm.stats()
    return loop.run(go())


def test_engine_error_mid_stream_is_an_sse_error_then_done(loop, server, monkeypatch):
    monkeypatch.setattr(server.llm, "generate", _failing_generate(server.llm.generate, after=2))
    r = call(loop, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 40, "ignore_eos": True, "stream": True})
    assert r.status_code == 200  # headers were already sent when the engine failed
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert set(err) == {"message", "type", "param", "code"} and "injected step failure" in err["message"]
    assert err["code"] == "engine_error"
    assert any(e["choices"] and e["choices"][0]["text"] for e in events[:-2])  # tokens before the failure
    monkeypatch.undo()
    s = _wait_idle(loop, server)
    assert s["kv_blocks_used"] == 0
    # The engine is fine: the next request succeeds.
    assert call(loop, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 4}).status_code == 200


def test_engine_error_before_first_token_is_a_500_envelope(loop, server, monkeypatch):
    monkeypatch.setattr(server.llm, "generate", _failing_generate(server.llm.generate, after=0))
    r = call(loop, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 5})
    assert_envelope(r, 500, code="engine_error")
    monkeypatch.undo()


def test_failure_touches_only_the_failing_request(loop, server, monkeypatch):
    real = server.llm.generate
    failing = _failing_generate(real, after=1)
    monkeypatch.setattr(server.llm, "generate",
                        lambda p, sp, rid, *a: failing(p, sp, rid, *a) if sp.seed == 13 else real(p, sp, rid, *a))

    async def both():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://peagle") as c:
            bad = c.post("/v1/completions", json={"prompt": "x y", "max_tokens": 20, "seed": 13, "stream": True,
                                                  "ignore_eos": True}, headers=AUTH)
            good = c.post("/v1/completions", json={"prompt": "x y", "max_tokens": 20, "ignore_eos": True},
                          headers=AUTH)
            return await asyncio.gather(bad, good)
    bad, good = loop.run(both())
    assert sse_events(bad.text)[-2]["error"]["code"] == "engine_error"
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 20


def test_closing_a_replica_stream_aborts_and_frees_kv_blocks(loop, server):
    """The replica half of a client disconnect: the router cancels, the replica's generator closes."""
    async def go():
        before = server.aborted
        req = {"request_id": "disc-1", "kind": "completion", "prompt": "a b c",
               "sampling": {"max_tokens": 200, "ignore_eos": True, "temperature": 0}, "max_tokens": 200}
        agen = server.generate(req)
        events = [await agen.__anext__() for _ in range(3)]
        assert all(e["event"] == "delta" for e in events)
        used_during = server.llm.stats()["kv_blocks_used"]
        await agen.aclose()
        return before, used_during
    before, used_during = loop.run(go())
    assert used_during > 0
    s = _wait_idle(loop, server)
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0
    assert server.aborted == before + 1 and server.ongoing == 0


def test_health_reports_a_dead_engine(loop, server, monkeypatch):
    from peagle_core.engine.async_llm import EngineDeadError

    def dead():
        raise EngineDeadError("engine loop exited")
    monkeypatch.setattr(server.llm, "check_health", dead)
    with pytest.raises(EngineDeadError):
        server.check_health()  # what Serve's controller calls: raising gets the replica replaced
    assert_envelope(call(loop, "GET", "/health", headers={}), 503, code="unhealthy")


def test_shutdown_ends_in_flight_streams_with_an_error_event(loop, server):
    settings = parse_app_args(ARGS | {"api_key": None})
    srv = loop.run(_make_server(settings))
    frontend = Frontend(settings, LocalHandle(srv))

    async def go():
        install_frontend(frontend)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://peagle",
                                     timeout=60) as c:
            async def stop_soon():
                for _ in range(400):
                    if srv.llm.stats()["num_running"]:
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.05)
                srv.shutdown()
            stopper = asyncio.create_task(stop_soon())
            r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 230, "ignore_eos": True,
                                                       "stream": True})
            await stopper
            after = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            return r, after
    try:
        r, after = loop.run(go())
    finally:
        install_frontend(Frontend(parse_app_args(ARGS), LocalHandle(server)))
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    last = events[-2]
    # Either an error event or a finish chunk with finish_reason "abort": never a cut stream.
    assert ("error" in last) or (last["choices"] and last["choices"][0]["finish_reason"] == "abort"), last
    assert after.status_code == 503  # a closed replica takes no new work


async def _make_server(settings):
    return EngineServer(settings.model_dump(), replica_id="short-lived")


# --------------------------------------------------------------------------------------------
# Telemetry
# --------------------------------------------------------------------------------------------

def test_spans_chain_router_replica_engine_with_latency_and_spec_attributes(loop, server):
    r = call(loop, "POST", "/v1/completions", {"prompt": "trace me", "max_tokens": 12, "ignore_eos": True,
                                               "temperature": 0},
             headers=AUTH | {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    rid = r.json()["id"]
    spans = finished_spans()
    router = next(s for s in spans if s["name"] == "router.completion" and s["attributes"].get("gen_ai.request.id") == rid)
    replica = next(s for s in spans if s["name"] == "replica.generate" and s["attributes"].get("gen_ai.request.id") == rid)
    engine = next(s for s in spans if s["name"] == "engine.generate" and s["parent_id"] == replica["span_id"])
    # One trace, joined to the caller's traceparent: router -> replica -> engine.
    assert router["trace_id"] == replica["trace_id"] == engine["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert replica["parent_id"] == router["span_id"]
    a = engine["attributes"]
    assert a["gen_ai.usage.completion_tokens"] == 12
    assert a["gen_ai.latency.time_to_first_token"] >= 0 and a["gen_ai.latency.time_in_model_decode"] >= 0
    assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"]
    assert replica["attributes"]["peagle.latency.time_in_serve_queue"] >= 0
    assert a["gen_ai.latency.time_in_queue"] >= 0 and a["gen_ai.latency.time_in_model_prefill"] >= 0
    # P-EAGLE with K=3 drafted: the request's own speculation statistics are on the span.
    assert a["peagle.spec.num_drafts"] > 0
    assert a["peagle.spec.num_draft_tokens"] >= a["peagle.spec.num_drafts"]
    assert 1.0 <= a["peagle.spec.acceptance_length"] <= 4.0
    assert sum(a["peagle.spec.num_accepted_tokens_per_pos"]) == a["peagle.spec.num_accepted_tokens"]


def test_replica_metrics_count_tokens_and_speculation(loop, server):
    before = server.metrics.snapshot()
    r = call(loop, "POST", "/v1/completions", {"prompt": "count me", "max_tokens": 10, "ignore_eos": True})
    assert r.status_code == 200

    async def settle():
        await asyncio.sleep(0.5)  # one poll interval (0.2 s) and then some
        return server.metrics.snapshot(), await server.stats()
    after, stats = loop.run(settle())
    assert after["generation_tokens_total"] - before.get("generation_tokens_total", 0) == 10
    assert after["ttft_count"] - before.get("ttft_count", 0) == 1
    spec = stats["engine"]["spec"]
    assert after["num_drafts"] == spec["num_drafts"] > 0  # counters mirror the engine's cumulative stats
    assert after["num_accepted_tokens"] == spec["num_accepted_tokens"]
    assert after["kv_blocks_total"] == stats["engine"]["kv_blocks_total"] > 0
    assert after.get("speculation_depth") is not None


# --------------------------------------------------------------------------------------------
# Pure pieces
# --------------------------------------------------------------------------------------------

HARMONY = ("<|channel|>analysis<|message|>User says hi. Reply.<|end|><|start|>assistant<|channel|>final"
           "<|message|>Hello! How can I help?<|return|>")


def test_harmony_parser_splits_channels_at_any_chunk_boundary():
    whole = HarmonyParser().feed(HARMONY, final=True)
    assert whole == ("Hello! How can I help?", "User says hi. Reply.", [])
    for cut in range(1, len(HARMONY)):
        p = HarmonyParser()
        c1, r1, _ = p.feed(HARMONY[:cut])
        c2, r2, _ = p.feed(HARMONY[cut:], final=True)
        assert (c1 + c2, r1 + r2, []) == whole, cut
    assert HarmonyParser().feed("plain text <b>", final=True) == ("plain text <b>", "", [])


def test_request_models_follow_openai_types():
    parse = lambda body: P.parse_request(P.CompletionRequest, json.dumps(body).encode())
    assert parse({"prompt": "a", "temperature": 1}).temperature == 1.0  # ints are numbers
    assert parse({"prompt": [[1, 2]]}).single_prompt() == [1, 2]
    assert parse({"prompt": ["hi"]}).single_prompt() == "hi"
    for bad in ({"prompt": "a", "max_tokens": 1.5}, {"prompt": "a", "temperature": True}, {"prompt": 5},
                {"prompt": [1, "a"]}, {"prompt": "a", "stream_options": {"include_usage": "yes"}}):
        with pytest.raises(P.APIError) as e:
            parse(bad)
        assert e.value.status == 400
    chat = P.parse_request(P.ChatCompletionRequest, json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "max_completion_tokens": 7, "max_tokens": 3, "stop": "x"}).encode())
    assert chat.requested_max_tokens() == 7 and chat.stop == ["x"]
    assert chat.sampling_kwargs(None) == {"max_tokens": 7, "stop": ["x"]}


def test_reasoning_effort_reaches_the_harmony_system_message(loop, server):
    messages = [{"role": "user", "content": "Hi"}]
    tok = server.llm.tokenizer
    for effort in ("low", "high"):
        body = call(loop, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                          "reasoning_effort": effort}).json()
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, reasoning_effort=effort,
                                         current_date=today())
        assert f"Reasoning: {effort}" in prompt
        assert body["usage"]["prompt_tokens"] == len(tok.encode(prompt))
    assert_envelope(call(loop, "POST", "/v1/chat/completions", {"messages": messages, "reasoning_effort": "max"}),
                    400, "reasoning_effort")


def test_otlp_exporter_is_used_only_when_an_endpoint_is_configured(tmp_path):
    """Tracing is process-global, so each case runs in a fresh interpreter."""
    import os
    import subprocess
    import sys

    probe = ("from peagle_cluster.telemetry import setup_tracing, tracer\n"
             "from opentelemetry import trace\n"
             "setup_tracing('auto')\n"
             "p = trace.get_tracer_provider()\n"
             "procs = getattr(getattr(p, '_active_span_processor', None), '_span_processors', ())\n"
             "print(type(p).__name__, [type(x.span_exporter).__name__ for x in procs])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    off = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    on = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                        env=env | {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    assert off.returncode == 0 and on.returncode == 0, off.stderr + on.stderr
    assert "OTLPSpanExporter" not in off.stdout and off.stdout.startswith("ProxyTracerProvider")
    assert on.stdout.startswith("TracerProvider") and "OTLPSpanExporter" in on.stdout


def test_usage_reports_cached_prompt_tokens_and_metrics_count_them(loop, server):
    """A second chat with the first one's long system prompt finds it in the prefix cache: OpenAI's
    usage.prompt_tokens_details.cached_tokens says how many prompt tokens (whole 16-token blocks), streamed or not,
    and the prefix-cache counters (vLLM's queries / hits, in tokens) mirror the engine's."""
    system = "You are a careful assistant who answers in one short sentence. " * 8
    before = server.metrics.snapshot()
    bodies = []
    for question in ("What is a list?", "What is a tuple?"):
        req = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
               "max_tokens": 4, "temperature": 0}
        bodies.append(call(loop, "POST", "/v1/chat/completions", req).json())
    r = call(loop, "POST", "/v1/chat/completions", req | {"stream": True, "stream_options": {"include_usage": True}})
    streamed = sse_events(r.text)[-2]["usage"]
    first, second = (b["usage"] for b in bodies)
    cached = second["prompt_tokens_details"]["cached_tokens"]
    # the first shares at most the chat template's preamble with earlier tests' chats; the second the system prompt
    assert cached - first["prompt_tokens_details"]["cached_tokens"] >= 64
    assert cached < second["prompt_tokens"] and cached % 16 == 0
    assert streamed["prompt_tokens_details"]["cached_tokens"] >= cached  # the same prompt again: all but its tail

    async def settle():
        await asyncio.sleep(0.5)
        return server.metrics.snapshot(), await server.stats()
    after, stats = loop.run(settle())
    hits = after["prefix_cache_hits"] - before.get("prefix_cache_hits", 0)
    assert hits == sum(u["prompt_tokens_details"]["cached_tokens"] for u in (first, second, streamed))
    assert after["prefix_cache_queries"] - before.get("prefix_cache_queries", 0) == sum(
        u["prompt_tokens"] for u in (first, second, streamed))
    assert after["kv_blocks_cached"] == stats["engine"]["kv_blocks_cached"] > 0


# --------------------------------------------------------------------------------------------
# Property: any JSON body gets a 2xx or a 4xx with a message, never a 5xx
# --------------------------------------------------------------------------------------------

def _fuzz_bodies():
    from hypothesis import strategies as st

    text = st.text(st.characters(codec=None), max_size=12)  # lone surrogates included
    scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**80, max_value=2**80),
                        st.integers(min_value=-3, max_value=40), st.floats(allow_nan=True, allow_infinity=True), text)
    values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3),
                          max_leaves=6)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard"])},
                                    optional={"content": st.one_of(text, text, values), "name": st.one_of(text, values)})
    def field(valid):  # one in ten out of range, so most requests also get past the schema into the engine
        return st.integers(0, 9).flatmap(lambda i: values if i == 0 else valid)

    fields = {"model": field(st.just("tiny")), "max_tokens": field(st.integers(1, 6)),
              "temperature": field(st.floats(0, 2)), "top_p": field(st.floats(0.01, 1)),
              "top_k": field(st.integers(-1, 300)), "seed": field(st.integers(-2**63, 2**64 - 1)),
              "n": field(st.integers(1, 2)), "stop": field(st.lists(text.filter(bool), max_size=4)),
              "stream": field(st.booleans()), "logprobs": field(st.just(False)), "ignore_eos": field(st.booleans()),
              "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
              "max_completion_tokens": field(st.integers(1, 6)),
              "reasoning_effort": field(st.sampled_from(["low", "medium", "high"])), "echo": field(st.just(False)),
              "suffix": field(st.just("")), "user": field(text)}
    # max_tokens always set (to null one time in ten): a chat without it generates to max_model_len, too slow here
    limit = {"max_tokens": fields.pop("max_tokens")}
    chat = st.fixed_dictionaries({"messages": st.one_of(st.lists(message, min_size=1, max_size=2), values), **limit},
                                 optional=fields)
    completion = st.fixed_dictionaries({"prompt": st.one_of(text, text, st.lists(field(st.integers(0, 300)), max_size=4),
                                                            values), **limit}, optional=fields)
    extra = st.dictionaries(text, values, max_size=2)
    return st.tuples(st.one_of(chat.map(lambda b: (True, b)), completion.map(lambda b: (False, b))), extra)


FUZZ_EXAMPLES = int(__import__("os").environ.get("PEAGLE_FUZZ_EXAMPLES", "100"))


def test_fuzzed_requests_never_get_a_5xx(loop, server):
    import time

    from hypothesis import HealthCheck, given, settings

    seen = {"n": 0, "2xx": 0, "4xx": 0}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_fuzz_bodies())
    def check(case):
        (chat, body), extra = case
        raw = json.dumps({**extra, **body}, allow_nan=True).encode()  # NaN / Infinity / \ud800 as a client may send
        t0 = time.perf_counter()
        r = call(loop, "POST", "/v1/chat/completions" if chat else "/v1/completions", raw=raw)
        seen["s"] = seen.get("s", 0) + time.perf_counter() - t0
        assert r.status_code < 500, (raw[:300], r.text[:300])
        if r.status_code >= 400:
            assert_envelope(r, r.status_code)
        seen["n"] += 1
        seen["2xx" if r.status_code < 300 else "4xx"] += 1

    check()
    print(f"fuzzed {seen['n']} requests: {seen['2xx']} 2xx, {seen['4xx']} 4xx, 0 5xx; {seen['s']:.1f} s in requests")
    assert seen["2xx"] > 0 and seen["4xx"] > 0  # both sides of the schema were reached
    assert _wait_idle(loop, server)["kv_blocks_used"] == 0


# --------------------------------------------------------------------------------------------
# The proxy middleware: what a client sees when the router dies under its request
# --------------------------------------------------------------------------------------------

def _through_failover(app) -> list[dict]:
    from peagle_cluster.failover import RouterFailureMiddleware

    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        sent.append(msg)

    async def go():
        await RouterFailureMiddleware(app)({"type": "http", "path": "/v1/completions"}, receive, send)
    asyncio.run(go())
    return sent


def _start_and_body(sent):
    start = next(m for m in sent if m["type"] == "http.response.start")
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert not bodies[-1].get("more_body") and all(m.get("more_body") for m in bodies[:-1])  # ended exactly once
    return start, b"".join(m.get("body", b"") for m in bodies)


def test_failover_answers_a_request_the_dead_router_left_unanswered():
    async def died(scope, receive, send):  # Serve's proxy after the replica actor died: no response at all
        return None
    start, body = _start_and_body(_through_failover(died))
    headers = dict(start["headers"])
    assert start["status"] == 503 and headers[b"retry-after"] == b"1"
    assert json.loads(body)["error"]["code"] == "router_unavailable"


def test_failover_ends_a_cut_stream_with_an_error_event_then_done():
    async def cut(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
        raise RuntimeError("replica died")  # or the proxy just returns: the same to the client
    start, body = _start_and_body(_through_failover(cut))
    events = sse_events(body.decode())
    assert start["status"] == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "router_unavailable"


def test_failover_turns_the_proxys_plain_text_errors_into_envelopes_and_leaves_the_rest():
    async def plain(scope, receive, send):  # e.g. Serve's "no replica / queue full" answer
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"text/plain"), (b"retry-after", b"3")]})
        await send({"type": "http.response.body", "body": b"Deployment \xff unavailable", "more_body": False})
    start, body = _start_and_body(_through_failover(plain))
    err = json.loads(body)["error"]
    assert start["status"] == 503 and dict(start["headers"])[b"retry-after"] == b"3" and "unavailable" in err["message"]

    async def ours(scope, receive, send):
        await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": {}}', "more_body": False})
    assert _through_failover(ours)[1]["body"] == b'{"error": {}}'  # the router's own answers pass untouched
