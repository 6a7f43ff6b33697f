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
from peagle_cluster.fields import field_table, support
from peagle_cluster.replica import EngineServer
from peagle_cluster.router import Frontend, api, install_frontend
from peagle_cluster.settings import parse_app_args
from test_cluster_app import ARGS, KEY, LocalHandle, Loop

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cluster.md"
USER = [{"role": "user", "content": "Hi"}]


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
