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
    ("n-two", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, None, 400, "n", None),
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

    async def gen(prompt, params, request_id):
        agen = real(prompt, params, request_id)
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
                        lambda p, sp, rid: failing(p, sp, rid) if sp.seed == 13 else real(p, sp, rid))

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
