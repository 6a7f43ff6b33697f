"""The API GPT-OSS users call, through the official `openai` client against the in-process app.

The router and a replica with the shipped tiny model run in-process as in test_cluster_app.py (its
`LocalHandle` harness); `openai.AsyncOpenAI` talks to the FastAPI app over httpx's ASGI transport.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from peagle_cluster import protocol as P
from peagle_core import SamplingParams
from peagle_cluster.fields import field_table, support
from peagle_cluster.router import api
from test_cluster_app import ARGS, KEY, loop, server  # noqa: F401  (the in-process app's fixtures)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cluster.md"
USER = [{"role": "user", "content": "Hi"}]


def client() -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://peagle/v1")
    return openai.AsyncOpenAI(base_url="http://peagle/v1", api_key=KEY, http_client=http, max_retries=0)


def chat(loop, **kw):
    async def go():
        async with client() as c:
            return await c.chat.completions.create(**{"model": "tiny", "messages": USER, **kw})
    return loop.run(go())


def complete(loop, **kw):
    async def go():
        async with client() as c:
            return await c.completions.create(**{"model": "tiny", "prompt": "Once", **kw})
    return loop.run(go())


def refused_by(loop, fn, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        fn(loop, **kw)
    return e.value


# --------------------------------------------------------------------------------------------
# 1. No silent drops
# --------------------------------------------------------------------------------------------

def test_docs_field_table_is_the_code():
    """docs/cluster.md carries the table the request models declare, row for row."""
    assert field_table(P.ChatCompletionRequest, P.CompletionRequest) in DOCS.read_text()


def test_the_fields_users_lost_are_declared():
    chat_fields, completion_fields = support(P.ChatCompletionRequest), support(P.CompletionRequest)
    for name in ("tools", "tool_choice", "parallel_tool_calls", "response_format", "top_logprobs"):
        assert name in chat_fields
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
                 "include_stop_str_in_output", "skip_special_tokens", "logprobs", "response_format"):
        assert name in chat_fields and name in completion_fields


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_refused_field_is_a_400_naming_it_unless_neutral(loop, server, endpoint):
    model, fn = (P.ChatCompletionRequest, chat) if endpoint == "chat" else (P.CompletionRequest, complete)
    for name, meta in support(model).items():
        if meta["support"] != "refused":
            continue
        e = refused_by(loop, fn, max_tokens=1, extra_body={name: "not-neutral"})
        assert e.body["param"] == name and name in e.body["message"], e.body
        assert e.body["code"] == "unsupported_parameter"
        for neutral in meta["neutral"]:
            fn(loop, max_tokens=1, extra_body={name: neutral})


def test_an_unknown_field_is_refused_by_name(loop, server):
    e = refused_by(loop, chat, max_tokens=1, extra_body={"some_future_field": {"x": 1}})
    assert e.body["param"] == "some_future_field" and "Unrecognized request argument" in e.body["message"]
    e = refused_by(loop, chat, max_tokens=1, messages=[{"role": "user", "content": "x", "colour": "red"}])
    assert e.body["param"] == "messages.0.colour"


def test_stop_token_ids_end_the_completion(loop, server):
    free = complete(loop, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    ids = server.llm.tokenizer.encode(free.choices[0].text)
    stopped = complete(loop, max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "stop_token_ids": [ids[2]]})
    assert stopped.choices[0].finish_reason == "stop"
    assert server.llm.tokenizer.encode(stopped.choices[0].text) == ids[:3]


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-3, 3, allow_nan=False)
                     | st.text(max_size=4), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


@st.composite
def _bodies(draw):
    chat_ = draw(st.booleans())
    model = P.ChatCompletionRequest if chat_ else P.CompletionRequest
    names = draw(st.lists(st.sampled_from(sorted(support(model))), max_size=4, unique=True))
    body = {n: draw(_JSON) for n in names}
    body.setdefault("messages" if chat_ else "prompt", USER if chat_ else "Once")
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(1, 3))
    else:
        body.pop("max_tokens", None)
        body.pop("max_completion_tokens", None)
        body["max_tokens" if not chat_ else "max_completion_tokens"] = 2
    return ("/v1/chat/completions" if chat_ else "/v1/completions"), body


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=_bodies())
def test_any_request_is_a_2xx_or_a_4xx_with_a_message(loop, server, req):
    path, body = req

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://peagle") as c:
            return await c.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    r = loop.run(go())
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


# --------------------------------------------------------------------------------------------
# 2. Tools and reasoning, the harmony way
# --------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City"}},
                   "required": ["location"]}}}
CALL_REPLY = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
              "to=functions.get_weather <|constrain|>json<|message|>{\"location\": \"Paris\"}<|call|>")


def decode_all(tok, reply: str, prefix: str = "", step: int = 1):
    """Feed a reply's token ids `step` at a time through a chat request's output path; concatenate what it emits."""
    ids = tok.encode(reply)
    content, reasoning, calls = "", "", {}
    for d in _replay(tok, [0], ids, SamplingParams(), prefix, step):
        content, reasoning = content + d.text, reasoning + d.reasoning
        for c in d.tool_calls:
            calls.setdefault(c["index"], {"name": None, "arguments": ""})
            if "name" in c:
                assert calls[c["index"]]["name"] is None  # the name comes once, first
                calls[c["index"]]["name"] = c["name"]
            calls[c["index"]]["arguments"] += c["arguments"]
    return content, reasoning, [calls[i] for i in sorted(calls)]


def test_tiny_tokenizer_has_harmony_tokens_as_single_ids(server):
    tok = server.llm.tokenizer
    for t in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"):
        assert tok.encode(t) == [tok.token_id(t)]
    assert tok.token_id("<|call|>") in server.llm.engine.stop_ids  # a call ends the turn


@pytest.mark.parametrize("step", [1, 2, 3, 100])
def test_a_commentary_call_to_a_function_parses_as_a_tool_call(server, step):
    tok = server.llm.tokenizer
    expect = ("", "Need the weather.", [{"name": "get_weather", "arguments": '{"location": "Paris"}'}])
    assert decode_all(tok, CALL_REPLY, step=step) == expect
    # harmony's renderer writes the recipient before the channel: both orders are a call
    other = CALL_REPLY.replace("<|channel|>commentary to=functions.get_weather ",
                               " to=functions.get_weather<|channel|>commentary ")
    assert decode_all(tok, other, step=step) == expect
    # commentary without a recipient is a preamble to the user: content
    assert decode_all(tok, "<|channel|>commentary<|message|>Checking.<|end|>", step=step) == ("Checking.", "", [])
    assert decode_all(tok, "<|channel|>final<|message|>Sunny.<|return|>", step=step) == ("Sunny.", "", [])


def test_a_forced_call_starts_inside_the_header(server):
    from peagle_core.loading.tokenizer import tool_call_prefill

    tok = server.llm.tokenizer
    named = decode_all(tok, '{"location": "Oslo"}<|call|>', prefix=tool_call_prefill("get_weather"))
    assert named == ("", "", [{"name": "get_weather", "arguments": '{"location": "Oslo"}'}])
    anyone = decode_all(tok, 'get_weather<|channel|>commentary <|constrain|>json<|message|>{}<|call|>',
                        prefix=tool_call_prefill(None))
    assert anyone == ("", "", [{"name": "get_weather", "arguments": "{}"}])


def scripted(server, reply: str, prompts: list[str], per_step: int = 2):
    """A stand-in for the engine's `generate` that answers `reply` (a harmony string), `per_step` tokens a step,
    and records each prompt it was given as text (the tiny model will not call tools by itself)."""
    from peagle_core.engine.output import delta_output

    tok = server.llm.tokenizer

    async def generate(prompt, params, request_id, chat_prefix=None):
        prompts.append(tok.decode(prompt, skip_special_tokens=False))
        for req, new, d in _replay(tok, prompt, tok.encode(reply), params, chat_prefix, per_step, with_req=True):
            yield delta_output(req, new, d, None)
    return generate


def _replay(tok, prompt, ids, params, chat_prefix, step, with_req=False):
    """The engine's output path (`OutputState`) over a reply given as ids, `step` ids a step."""
    from peagle_core.engine.output import OutputState
    from peagle_core.engine.request import Request, Status

    req = Request("replay", list(prompt), params)
    state = OutputState(tok, params, chat_prefix)
    for i in range(0, len(ids), step):
        new = ids[i:i + step]
        req.token_ids += new
        if i + step >= len(ids):
            req.status, req.finish_reason = Status.FINISHED, "stop"
        d = state.update(req)
        yield (req, new, d) if with_req else d


def test_tool_calls_through_the_openai_client(loop, server, monkeypatch):
    from peagle_core.loading.harmony_tools import tools_section

    prompts: list[str] = []
    monkeypatch.setattr(server.llm, "generate", scripted(server, CALL_REPLY, prompts))
    r = chat(loop, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"location": "Paris"} and not choice.message.content
    assert choice.message.model_extra["reasoning"] == "Need the weather." == choice.message.model_extra["reasoning_content"]
    # the tools reached the prompt as harmony declares them, with the system message's tool line
    assert tools_section([WEATHER["function"]]) in prompts[-1]
    assert "Calls to these tools must go to the commentary channel: 'functions'." in prompts[-1]
    assert re.search(r"Current date: \d{4}-\d\d-\d\d", prompts[-1])

    async def stream():
        async with client() as c:
            s = await c.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], stream=True)
            return [chunk async for chunk in s]
    chunks = loop.run(stream())
    deltas = [t for ch in chunks for t in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].id == call.id or deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_weather" and all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # include_reasoning: false leaves reasoning out
    r = chat(loop, tools=[WEATHER], extra_body={"include_reasoning": False})
    assert "reasoning" not in (r.choices[0].message.model_extra or {})


def test_multi_turn_with_tool_results_renders_back(loop, server, monkeypatch):
    prompts: list[str] = []
    monkeypatch.setattr(server.llm, "generate", scripted(server, "<|channel|>final<|message|>It is sunny.<|return|>",
                                                         prompts))
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "reasoning": "Need the weather.",
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}]
    r = chat(loop, messages=history, tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    assert prompts[-1].endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
        '{"location": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sky": "sunny"}<|end|>'
        "<|start|>assistant")
    # a reply appended as the openai client returns it renders too (its empty fields pass)
    again = history[:1] + [r.choices[0].message.model_dump()] + [{"role": "user", "content": "Thanks"}]
    chat(loop, messages=again, tools=[WEATHER])
    assert "<|start|>assistant<|channel|>final<|message|>It is sunny.<|end|>" in prompts[-1]


def test_tool_choice(loop, server, monkeypatch):
    from peagle_core.loading.tokenizer import tool_call_prefill

    prompts: list[str] = []
    monkeypatch.setattr(server.llm, "generate", scripted(server, '{"location": "Rome"}<|call|>', prompts))
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(loop, tools=[WEATHER], tool_choice=named)
    assert prompts[-1].endswith("<|start|>assistant" + tool_call_prefill("get_weather"))
    assert r.choices[0].message.tool_calls[0].function.arguments == '{"location": "Rome"}'
    assert r.choices[0].finish_reason == "tool_calls"

    monkeypatch.setattr(server.llm, "generate", scripted(
        server, "get_weather<|channel|>commentary <|constrain|>json<|message|>{}<|call|>", prompts))
    r = chat(loop, tools=[WEATHER], tool_choice="required")
    assert prompts[-1].endswith("<|start|>assistant to=functions.")
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"

    monkeypatch.setattr(server.llm, "generate", scripted(server, "<|channel|>final<|message|>Hi<|return|>", prompts))
    assert chat(loop, tools=[WEATHER], tool_choice="none").choices[0].message.content == "Hi"
    assert "# Tools" not in prompts[-1] and "functions" not in prompts[-1]
    chat(loop, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False)
    assert "namespace functions" in prompts[-1] and prompts[-1].endswith("<|start|>assistant")


@pytest.mark.parametrize("kw,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_9", "content": "{}"}]},
     "messages"),
])
def test_bad_tool_requests_are_400s(loop, server, kw, param):
    e = refused_by(loop, chat, max_tokens=1, **kw)
    assert (e.body["param"] or "").startswith(param) or param in e.body["message"], e.body


# --------------------------------------------------------------------------------------------
# 3. /tokenize, /detokenize, /version, /metrics; per-request speculative metrics; usage details
# --------------------------------------------------------------------------------------------

def http(loop, method: str, path: str, body=None, auth: bool = True) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://peagle") as c:
            return await c.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"} if auth else {})
    return loop.run(go())


def test_tokenize_and_detokenize(loop, server):
    tok = server.llm.tokenizer
    prompt = "The quick brown fox"
    r = http(loop, "POST", "/tokenize", {"model": "tiny", "prompt": prompt, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(prompt) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert len(r["token_strs"]) == r["count"]
    assert http(loop, "POST", "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": prompt}
    # chat: the ids the chat endpoint would feed the model, so the count is its usage.prompt_tokens
    for kw in ({}, {"tools": [WEATHER], "reasoning_effort": "high"}):
        t = http(loop, "POST", "/tokenize", {"messages": USER, **kw}).json()
        assert t["count"] == chat(loop, max_tokens=1, **kw).usage.prompt_tokens
    for path, body, param in (("/tokenize", {"prompt": "a", "messages": USER}, None),
                              ("/tokenize", {"prompt": "a", "colour": 1}, "colour"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens")):
        r = http(loop, "POST", path, body)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
        assert param is None or r.json()["error"]["param"].startswith(param)
    assert http(loop, "POST", "/tokenize", {"prompt": "a"}, auth=False).status_code == 401


def test_version(loop, server):
    from importlib.metadata import version

    assert http(loop, "GET", "/version").json() == {"version": version("peagle")}


def _scrape(loop) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = http(loop, "GET", "/metrics", auth=False)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_metrics_use_vllms_names_and_count_what_responses_report(loop, server):
    before = _scrape(loop)
    label = (("model_name", "tiny"),)
    got = lambda m, key, lab=label: m.get((key, lab), 0.0)
    replies = [complete(loop, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}),
               chat(loop, max_tokens=12, temperature=1, seed=3, extra_body={"ignore_eos": True})]
    after = _scrape(loop)
    specs = [r.model_extra["metrics"]["speculative_decoding"] for r in replies]
    for r, s in zip(replies, specs):
        assert 0 <= r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens  # earlier tests' prefixes
        assert s["num_spec_tokens"] == 3 and len(s["acceptance_histogram"]) == 4
        assert sum(s["acceptance_histogram"]) == s["num_spec_steps"] > 0
        assert sum(j * n for j, n in enumerate(s["acceptance_histogram"])) == s["num_accepted_draft_tokens"]
        assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_draft_tokens"] / s["num_spec_steps"])
        assert s["draft_acceptance_rate"] == pytest.approx(s["num_accepted_draft_tokens"] / s["num_draft_tokens"])
    delta = lambda key: got(after, key) - got(before, key)
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == sum(s["num_accepted_draft_tokens"] for s in specs)
    assert delta("vllm:spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for s in specs)
    assert delta("vllm:spec_decode_num_drafts_total") == sum(s["num_spec_steps"] for s in specs)
    assert delta("vllm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in replies)
    assert delta("vllm:prefix_cache_queries_total") == delta("vllm:prompt_tokens_total")
    assert delta("vllm:prefix_cache_hits_total") == sum(r.usage.prompt_tokens_details.cached_tokens for r in replies)
    assert delta("vllm:generation_tokens_total") == sum(r.usage.completion_tokens for r in replies) == 24
    assert delta("vllm:time_to_first_token_seconds_count") == 2 == delta("vllm:e2e_request_latency_seconds_count")
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 2
    assert delta("vllm:request_generation_tokens_sum") == 24 and delta("vllm:request_time_per_output_token_seconds_count") == 2
    # one gap a step after the first: fewer than the tokens when the target accepted drafts
    steps = sum(s["num_spec_steps"] for s in specs)
    assert 0 < delta("vllm:inter_token_latency_seconds_count") <= 22 and steps >= delta("vllm:inter_token_latency_seconds_count")
    length = (("finished_reason", "length"),) + label
    assert got(after, "vllm:request_success_total", length) - got(before, "vllm:request_success_total", length) == 2
    assert 0.0 <= got(after, "vllm:kv_cache_usage_perc") <= 1.0
    assert ("vllm:num_requests_running", label) in after and ("vllm:num_requests_waiting", label) in after


def test_streams_carry_speculative_metrics_and_usage_details(loop, server):
    async def go():
        async with client() as c:
            s = await c.completions.create(model="tiny", prompt="Once", max_tokens=8, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            return [chunk async for chunk in s]
    chunks = loop.run(go())
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].model_extra["metrics"]["speculative_decoding"]["num_spec_steps"] > 0
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


# --------------------------------------------------------------------------------------------
# 4. logprobs / top_logprobs (their values: tests/test_logprobs.py)
# --------------------------------------------------------------------------------------------

def test_logprobs_on_completions_and_chat(loop, server):
    from peagle_core import LLM, SamplingParams

    tok = server.llm.tokenizer
    prompt = tok.encode("Once upon a time")
    offline = LLM("tiny", device="cpu", dtype="float32", max_model_len=256,
                  speculative_config=ARGS["speculative_config"]).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True))[0].outputs[0]
    r = complete(loop, prompt=prompt, max_tokens=10, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    table = tok.token_bytes(False)
    assert lp.tokens == [table[i].decode("utf-8", "replace") for i in offline.token_ids]
    assert lp.token_logprobs == pytest.approx([d[i].logprob for i, d in zip(offline.token_ids, offline.logprobs)],
                                              abs=1e-4)
    assert all(len(t) == 2 and max(t.values()) == pytest.approx(v, abs=1e-6)
               for t, v in zip(lp.top_logprobs, lp.token_logprobs))  # greedy: the emitted token is the top one
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(10)] and "".join(lp.tokens) == r.choices[0].text

    async def stream():
        async with client() as c:
            s = await c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
                                           stream=True, extra_body={"ignore_eos": True})
            return [ch async for ch in s]
    chunks = loop.run(stream())
    streamed = [v for ch in chunks if ch.choices and ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    offsets = [o for ch in chunks if ch.choices and ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert streamed == lp.token_logprobs and offsets == lp.text_offset

    c = chat(loop, max_tokens=6, temperature=0.7, seed=5, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and bytes(e.bytes).decode("utf-8", "replace") == e.token
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-6
    assert chat(loop, max_tokens=2).choices[0].logprobs is None


@pytest.mark.parametrize("fn,kw,param", [
    (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (chat, {"top_logprobs": 2}, None),
    (chat, {"extra_body": {"logprobs": 3}}, None),
    (complete, {"extra_body": {"logprobs": True}}, "logprobs"),
    (complete, {"logprobs": 21}, "logprobs"),
])
def test_bad_logprobs_requests_are_400s(loop, server, fn, kw, param):
    e = refused_by(loop, fn, max_tokens=1, **kw)
    assert param is None or (e.body["param"] or "").startswith(param), e.body


def test_penalties_reach_the_engine(loop, server):
    from peagle_core import LLM, SamplingParams

    tok = server.llm.tokenizer
    prompt = tok.encode("The quick brown fox")
    kw = dict(presence_penalty=0.5, frequency_penalty=0.3, logit_bias={280: -5.0}, min_tokens=2)
    offline = LLM("tiny", device="cpu", dtype="float32", max_model_len=256).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **kw))[0].outputs[0]
    body = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "min_tokens": 2, "ignore_eos": True}
    r = complete(loop, prompt=prompt, max_tokens=16, temperature=0, logit_bias={"280": -5}, extra_body=body)
    assert r.choices[0].text == offline.text
    assert r.choices[0].text != complete(loop, prompt=prompt, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    for bad, param in (({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
                       ({"presence_penalty": 2.5}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                       ({"logit_bias": {"99999999": 1}}, None)):
        e = refused_by(loop, complete, max_tokens=1, extra_body=bad)
        assert param is None or (e.body["param"] or "").startswith(param), e.body


def _stream_text(loop, **kw) -> str:
    async def go():
        async with client() as c:
            s = await c.completions.create(model="tiny", stream=True, **kw)
            return "".join([ch.choices[0].text async for ch in s if ch.choices])
    return loop.run(go())


def test_include_stop_str_and_special_tokens_in_completions(loop, server):
    from peagle_core import LLM, SamplingParams

    tok = server.llm.tokenizer
    free = complete(loop, prompt="Once upon a time", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop = text[8:11]
    cut = text.index(stop)
    kw = dict(prompt="Once upon a time", max_tokens=24, temperature=0, stop=stop)
    assert complete(loop, **kw).choices[0].text == text[:cut]
    both = {"include_stop_str_in_output": True, "ignore_eos": True}
    kept = complete(loop, **kw, extra_body=both).choices[0].text
    assert kept == text[:cut + len(stop)] == _stream_text(loop, **kw, extra_body=both)
    offline = LLM("tiny", device="cpu", dtype="float32", max_model_len=256).generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=24, stop=stop, include_stop_str_in_output=True,
                                           ignore_eos=True))[0].outputs[0].text
    assert offline == kept

    chat_prompt = tok.encode(tok.apply_chat_template(USER))
    raw = complete(loop, prompt=chat_prompt, max_tokens=6, temperature=0, extra_body={"skip_special_tokens": False})
    plain = complete(loop, prompt=chat_prompt, max_tokens=6, temperature=0)
    assert raw.choices[0].text.startswith("<|channel|>") and "<|" not in plain.choices[0].text
    assert _stream_text(loop, prompt=chat_prompt, max_tokens=6, temperature=0,
                        extra_body={"skip_special_tokens": False}) == raw.choices[0].text
    e = refused_by(loop, chat, max_tokens=1, extra_body={"skip_special_tokens": False})
    assert "skip_special_tokens" in e.body["message"]


def test_several_prompts_in_one_completions_request(loop, server):
    tok = server.llm.tokenizer
    prompts = ["Once upon a time", tok.encode("The quick brown fox"), "Hello"]
    kw = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    singles = [complete(loop, prompt=p, **kw) for p in prompts]
    r = complete(loop, prompt=prompts, logprobs=1, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert all("".join(c.logprobs.tokens) == c.text and len(c.logprobs.tokens) == 8 for c in r.choices)
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles) and r.usage.completion_tokens == 24
    spec = r.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_spec_steps"] == sum(s.model_extra["metrics"]["speculative_decoding"]["num_spec_steps"]
                                         for s in singles)

    async def stream():
        async with client() as c:
            s = await c.completions.create(model="tiny", prompt=prompts, stream=True,
                                           stream_options={"include_usage": True}, **kw)
            return [ch async for ch in s]
    chunks = loop.run(stream())
    texts = ["".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in r.choices]
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 24

    e = refused_by(loop, complete, prompt=["fine", " ".join(map(str, range(400)))], max_tokens=2)
    assert "prompt 1" in e.body["message"] and e.body["code"] == "context_length_exceeded"


# --------------------------------------------------------------------------------------------
# n, allowed_token_ids, bad_words, min_tokens with stop strings (their exactness: test_logits_processors.py)
# --------------------------------------------------------------------------------------------

def _offline():
    from peagle_core import LLM

    return LLM("tiny", device="cpu", dtype="float32", max_model_len=256, speculative_config=ARGS["speculative_config"])


def test_n_samples_are_the_seeded_single_requests_on_both_endpoints(loop, server):
    kw = dict(max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    singles = [complete(loop, seed=7 + i, **kw) for i in range(3)]
    r = complete(loop, n=3, seed=7, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert r.usage.completion_tokens == 30 and r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    # several prompts and n: choice index = prompt x n + sample
    two = complete(loop, prompt=["Once", "Hello"], n=2, seed=7, **kw)
    hello = [complete(loop, prompt="Hello", seed=7 + i, **kw).choices[0].text for i in range(2)]
    assert [c.text for c in two.choices] == [s.choices[0].text for s in singles[:2]] + hello

    chats = [chat(loop, seed=3 + i, **kw).choices[0].message for i in range(2)]
    c = chat(loop, n=2, seed=3, **kw)
    assert [(x.index, x.message.content, x.message.model_extra.get("reasoning")) for x in c.choices] == \
        [(i, m.content, m.model_extra.get("reasoning")) for i, m in enumerate(chats)]

    async def stream(**body):
        async with client() as cl:
            s = await cl.chat.completions.create(model="tiny", messages=USER, stream=True,
                                                 stream_options={"include_usage": True}, **body)
            return [ch async for ch in s]
    chunks = loop.run(stream(n=2, seed=3, **kw))
    for i, m in enumerate(chats):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == c.choices[i].finish_reason
        assert "".join(x.delta.content or "" for x in mine) == (m.content or "")
        assert "".join(x.delta.model_extra.get("reasoning") or "" for x in mine) == (m.model_extra.get("reasoning") or "")
    assert chunks[-1].usage.completion_tokens == c.usage.completion_tokens == 20
    # unseeded samples are independent draws
    free = complete(loop, n=4, **kw)
    assert len({x.text for x in free.choices}) == 4


def test_allowed_token_ids_bad_words_and_min_tokens_reach_the_engine(loop, server):
    from peagle_core import SamplingParams
    from peagle_core.engine.logits_processors import bad_words_ids

    llm = _offline()
    tok = llm.tokenizer
    prompt = tok.encode("Once upon a time")
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    allowed = sorted(set(free.token_ids[2:6]) | set(range(100, 160)))
    words = [tok.decode(free.token_ids[i:i + 2]) for i in (0, 4)]
    text = free.text
    stop = text[1:3]
    for body in ({"allowed_token_ids": allowed}, {"bad_words": words}, {"min_tokens": 6, "stop": [stop]}):
        sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **body)
        want = llm.generate([prompt], sp)[0].outputs[0]
        if "allowed_token_ids" in body:
            assert set(want.token_ids) <= set(allowed)
        if "bad_words" in body:
            bad = bad_words_ids(tok, words)
            assert not any(want.token_ids[i:i + len(w)] == w for w in bad for i in range(len(want.token_ids)))
        stop_kw = {"stop": body.pop("stop")} if "stop" in body else {}
        r = complete(loop, prompt=prompt, max_tokens=20, temperature=0, **stop_kw,
                     extra_body={"ignore_eos": True, **body})
        assert r.choices[0].text == want.text != text
    for bad, param in (({"allowed_token_ids": []}, "allowed_token_ids"),
                       ({"allowed_token_ids": [10**9]}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words"),
                       ({"allowed_token_ids": [-1]}, "allowed_token_ids"), ({"n": 65}, "n")):
        e = refused_by(loop, complete, max_tokens=1, extra_body=bad)
        assert (e.body["param"] or "").startswith(param), e.body
