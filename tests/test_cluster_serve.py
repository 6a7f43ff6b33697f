"""A real Ray Serve instance running configs/tiny.yaml's application, driven over HTTP.

Ray and the application start once for the module (two engine replicas on CPU, each with one
thread) and shut down at the end. The official `openai` client does the happy paths; raw `httpx`
checks status codes, SSE framing, disconnects and backpressure; the Prometheus endpoint of Ray's
metrics agent is scraped for the exported metrics.
"""
from __future__ import annotations

import asyncio
import copy
import json
import re
import socket
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent
KEY = "serve-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_ONGOING, MAX_QUEUED = 2, 4  # a burst counts as queued until routed: queue >= burst size
BODY_TIMEOUT_S = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _test_args() -> dict:
    """configs/tiny.yaml's args with the knobs these tests need: two fixed replicas, small queues."""
    args = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["applications"][0]["args"])
    args["deployment"] = {"num_replicas": 2, "max_ongoing_requests": MAX_ONGOING, "max_queued_requests": MAX_QUEUED,
                          "ray_actor_options": {"num_cpus": 1}, "health_check_period_s": 5,
                          "max_constructor_retry_count": 1, "graceful_shutdown_timeout_s": 5}
    args.update(api_key=KEY, tracing={"exporter": "memory"}, metrics_interval_s=0.5, body_read_timeout_s=BODY_TIMEOUT_S)
    return args


@pytest.fixture(scope="module")
def cluster():
    from ray import serve

    from peagle_cluster.app import build_app

    http_port, metrics_port = _free_port(), _free_port()
    for attempt in range(2):  # a loaded machine can make Ray's node startup time out once
        try:
            ray.init(num_cpus=4, include_dashboard=False, _metrics_export_port=metrics_port,
                     _system_config={"metrics_report_interval_ms": 1000}, logging_level="WARNING")
            break
        except Exception:
            ray.shutdown()
            if attempt:
                raise
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        t0 = time.time()
        serve.run(build_app(_test_args()), name="peagle", route_prefix="/")
        print(f"serve app up in {time.time() - t0:.1f}s")
        yield {"url": f"http://127.0.0.1:{http_port}", "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _stats(cluster) -> dict:
    r = httpx.get(cluster["url"] + "/v1/stats", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(pred, timeout: float, what: str, interval: float = 0.25):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def _idle(cluster) -> dict | None:
    s = _stats(cluster)
    ok = s["num_replicas"] == 2 and s["kv_blocks_used"] == 0 and s["num_running"] == 0 and s["ongoing"] == 0
    return s if ok else None


# --------------------------------------------------------------------------------------------
# OpenAI client
# --------------------------------------------------------------------------------------------

def test_openai_client_chat_completion_and_streaming(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hello"}],
                                          max_tokens=12, temperature=0)
    assert chat.object == "chat.completion" and chat.model == "tiny"
    assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert 0 < chat.usage.completion_tokens <= 12 and chat.usage.prompt_tokens > 0

    done = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 10 and done.choices[0].finish_reason == "length"

    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == done.choices[0].text  # streaming changes the framing, not the tokens
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []

    cstream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hello"}],
                                             max_tokens=12, temperature=0, stream=True)
    deltas = list(cstream)
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == chat.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_models_health_and_raw_sse_framing(cluster, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    h = httpx.get(cluster["url"] + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    with httpx.stream("POST", cluster["url"] + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    blocks = body.strip("\n").split("\n\n")
    assert all(b.startswith("data: ") for b in blocks) and blocks[-1] == "data: [DONE]"
    assert json.loads(blocks[0][6:])["choices"][0]["delta"]["role"] == "assistant"


# --------------------------------------------------------------------------------------------
# Bad input through the real proxy
# --------------------------------------------------------------------------------------------

BAD = [
    ("malformed-json", b'{"prompt": ', AUTH, 400),
    ("wrong-type", {"prompt": "a", "max_tokens": "ten"}, AUTH, 400),
    ("out-of-range", {"prompt": "a", "temperature": 9}, AUTH, 400),
    ("too-long", {"prompt": " ".join(map(str, range(1500)))}, AUTH, 400),
    ("unknown-model", {"model": "gpt-5", "prompt": "a"}, AUTH, 404),
    ("missing-key", {"prompt": "a"}, {}, 401),
    ("body-too-large", {"prompt": "z" * (1024 * 1024 + 1)}, AUTH, 413),
    # hostile input (issue 57): bounded numbers, lone surrogates, deep JSON, huge integers
    ("top-k-past-int64", {"prompt": "hi", "max_tokens": 4, "top_k": 9223372036854775808}, AUTH, 400),
    ("seed-past-64-bits", {"prompt": "hi", "seed": 2**70}, AUTH, 400),
    ("surrogate-prompt", b'{"prompt": "\\ud800"}', AUTH, 400),
    ("surrogate-model", b'{"model": "\\ud800", "prompt": "a"}', AUTH, 400),
    ("nested-50000", b'{"prompt": "a", "x": ' + b"[" * 50000 + b"]" * 50000 + b"}", AUTH, 400),
    ("integer-5000-digits", b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}", AUTH, 400),
]


@pytest.mark.parametrize("name,body,headers,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_status_and_envelope_over_http(cluster, name, body, headers, status):
    kw = {"content": body, "headers": headers | {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": headers}
    r = httpx.post(cluster["url"] + "/v1/completions", timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text


def test_every_hostile_case_gets_its_4xx_envelope_beside_unharmed_requests(cluster):
    """Issue 57's attack as a table (tests/hostile_cases.py, 300+ named cases): each gets the 4xx it names in
    OpenAI's envelope, no traceback, within seconds, while greedy requests beside them keep their exact text and
    no replica counts an engine error."""
    from hostile_cases import CASES

    good = {"prompt": "a quiet", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    alone = httpx.post(cluster["url"] + "/v1/completions", json=good, headers=AUTH, timeout=60).json()
    errors_before = sum(r["errors"] for r in _wait(lambda: _idle(cluster), 30, "idle cluster")["replicas"])

    async def attack():
        gate, done, beside, wrong = asyncio.Semaphore(8), asyncio.Event(), [], []
        async with httpx.AsyncClient(base_url=cluster["url"], timeout=30) as c:
            async def normal():
                while not done.is_set():
                    beside.append(await c.post("/v1/completions", json=good, headers=AUTH))

            async def hostile(case):
                async with gate:
                    try:
                        r = await c.request(case.method, case.path, content=case.body, headers=AUTH | case.headers)
                    except httpx.TimeoutException:
                        return wrong.append((case.name, "hung"))
                    except httpx.HTTPError as e:
                        return wrong.append((case.name, repr(e)))
                    try:
                        err = r.json()["error"]
                        enveloped = set(err) == {"message", "type", "param", "code"} and err["message"]
                    except Exception:
                        enveloped = False
                    if r.status_code != case.status or not enveloped or "Traceback" in r.text:
                        wrong.append((case.name, r.status_code, r.text[:160]))
            users = [asyncio.create_task(normal()) for _ in range(2)]
            await asyncio.gather(*(hostile(case) for case in CASES))
            done.set()
            await asyncio.gather(*users)
        return beside, wrong
    t0 = time.time()
    beside, wrong = asyncio.run(attack())
    print(f"{len(CASES)} hostile cases and {len(beside)} requests beside them in {time.time() - t0:.1f}s")
    assert not wrong, wrong
    assert beside and all(r.status_code == 200 for r in beside), [r.text[:160] for r in beside if r.status_code != 200]
    assert all(r.json()["choices"][0]["text"] == alone["choices"][0]["text"] for r in beside)
    idle = _wait(lambda: _idle(cluster), 30, "idle cluster")
    assert sum(r["errors"] for r in idle["replicas"]) == errors_before


def test_a_stalled_body_gets_a_408_through_the_proxy(cluster):
    """Slowloris: headers promise 1000 bytes, 11 arrive; the answer comes after body_read_timeout_s, not minutes."""
    host, port = cluster["url"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ".encode())
        t0 = time.time()
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        took = time.time() - t0
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert BODY_TIMEOUT_S - 0.5 <= took < BODY_TIMEOUT_S + 10, took


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="a")
    assert "does not exist" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0).models.list()


# --------------------------------------------------------------------------------------------
# Routing, disconnects, backpressure
# --------------------------------------------------------------------------------------------

def test_two_replicas_both_receive_traffic_under_concurrent_load(cluster):
    before = {r["replica_id"]: r["served"] for r in _wait(lambda: _idle(cluster), 30, "idle cluster")["replicas"]}
    assert len(before) == 2
    n = 2 * MAX_ONGOING  # exactly what both replicas can hold: nothing queues, nothing is refused

    async def burst():
        async with httpx.AsyncClient(base_url=cluster["url"], headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 24,
                                                                         "ignore_eos": True}) for i in range(n)])
    results = asyncio.run(burst())
    assert [r.status_code for r in results] == [200] * n
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in results)

    seen = []

    def served():  # replicas post their counters every 0.5 s, fire and forget: wait for the burst to show
        s = _stats(cluster)
        delta = {r["replica_id"]: r["served"] - before.get(r["replica_id"], 0) for r in s["replicas"]}
        seen.append(delta)
        return delta if sum(delta.values()) >= n else None
    try:
        delta = _wait(served, 60, "per-replica served counters")
    except AssertionError as e:
        raise AssertionError(f"{e}; last counters seen: {seen[-1] if seen else None}") from None
    # Power of two choices on ongoing requests: with both replicas in the pair, each takes a share.
    assert len(delta) == 2 and all(v >= 1 for v in delta.values()), delta


def test_the_issues_poisoned_request_leaves_concurrent_requests_unharmed(cluster):
    """Issue 57's reproducer sent while other requests run on both replicas: a 400 naming top_k for it, the
    exact greedy text for the others, and no engine error anywhere."""
    good = {"prompt": "tell me", "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    alone = httpx.post(cluster["url"] + "/v1/completions", json=good, headers=AUTH, timeout=60).json()

    async def together():
        async with httpx.AsyncClient(base_url=cluster["url"], headers=AUTH, timeout=120) as c:
            running = [asyncio.create_task(c.post("/v1/completions", json=good)) for _ in range(3)]
            await asyncio.sleep(0.2)  # the good ones are in their engines' steps
            poisoned = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                              "top_k": 9223372036854775808})
            return poisoned, await asyncio.gather(*running)
    poisoned, results = asyncio.run(together())
    assert poisoned.status_code == 400 and poisoned.json()["error"]["param"] == "top_k"
    assert [r.status_code for r in results] == [200] * 3
    assert all(r.json()["choices"][0]["text"] == alone["choices"][0]["text"] for r in results)
    assert all(r["errors"] == 0 for r in _wait(lambda: _idle(cluster), 30, "idle cluster")["replicas"])


def test_client_disconnect_mid_stream_frees_kv_blocks(cluster):
    before = _wait(lambda: _idle(cluster), 30, "idle cluster")
    aborted_before = sum(r["aborted"] for r in before["replicas"])
    with httpx.stream("POST", cluster["url"] + "/v1/completions", headers=AUTH, timeout=120,
                      json={"prompt": "tell me a long story", "max_tokens": 900, "ignore_eos": True,
                            "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(g.startswith("data: {") for g in got)
        busy = _wait(lambda: (s := _stats(cluster))["kv_blocks_used"] > 0 and s, 10, "blocks in use while streaming")
        assert busy["num_running"] == 1
    # Leaving the `with` closed the connection mid-stream.
    after = _wait(lambda: _idle(cluster), 15, "the aborted request's KV blocks to be freed")
    assert after["kv_blocks_used"] == 0 and after["num_running"] == 0
    assert sum(r["aborted"] for r in after["replicas"]) == aborted_before + 1


def test_backpressure_returns_503_envelope_when_queues_are_full(cluster):
    _wait(lambda: _idle(cluster), 30, "idle cluster")
    extra = 3
    statuses: list[tuple[int, dict, dict]] = []
    body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}

    async def one(c, hold: asyncio.Event):
        async with c.stream("POST", "/v1/completions", json=body) as r:
            payload = json.loads(await r.aread()) if r.status_code != 200 else {}
            statuses.append((r.status_code, payload, dict(r.headers)))
            await hold.wait()  # keep a 200 stream (and its replica slot) open

    async def until(pred, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline and not pred():
            await asyncio.sleep(0.05)

    async def run():
        hold = asyncio.Event()
        async with httpx.AsyncClient(base_url=cluster["url"], headers=AUTH, timeout=120) as c:
            # 1) Fill every replica slot, one request at a time, so none is refused as part of a burst.
            running = []
            for i in range(2 * MAX_ONGOING):
                running.append(asyncio.create_task(one(c, hold)))
                await until(lambda: len(statuses) > i, 60)
            full = [s for s, _, _ in statuses]
            # 2) Now a burst: the router's queue takes MAX_QUEUED, the rest is refused at once.
            burst = [asyncio.create_task(one(c, hold)) for _ in range(MAX_QUEUED + extra)]
            await until(lambda: len(statuses) >= 2 * MAX_ONGOING + extra, 30)
            await asyncio.sleep(0.5)  # nothing else may come back while the replicas are full
            refused = statuses[2 * MAX_ONGOING:]
            for t in running + burst:
                t.cancel()  # disconnect everything still open (the queued requests included)
            await asyncio.gather(*running, *burst, return_exceptions=True)
            return full, refused
    full, refused = asyncio.run(run())
    assert full == [200] * (2 * MAX_ONGOING)
    assert [s for s, _, _ in refused] == [503] * extra
    for _, payload, headers in refused:
        err = payload["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "overloaded"
        assert headers.get("retry-after") == "1"
    # Every disconnected stream was aborted and every queued one dropped: nothing stays allocated.
    _wait(lambda: _idle(cluster), 30, "KV blocks freed after the disconnects")


# --------------------------------------------------------------------------------------------
# Telemetry
# --------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^(ray_peagle_[a-z0-9_]+)\{([^}]*)\}\s+([0-9.eE+-]+)$')


def _scrape(url: str) -> list[tuple[str, dict, float]]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def test_metrics_are_exported_to_prometheus(cluster, client):
    client.completions.create(model="tiny", prompt="metrics please", max_tokens=16, extra_body={"ignore_eos": True})
    for bad in ({"prompt": "a", "temperature": 9}, {"model": "gpt-5", "prompt": "a"}):  # a 400 and a 404
        httpx.post(cluster["url"] + "/v1/completions", json=bad, headers=AUTH, timeout=30)
    need = {"ray_peagle_time_to_first_token_seconds_count", "ray_peagle_time_per_output_token_seconds_count",
            "ray_peagle_e2e_request_latency_seconds_count", "ray_peagle_generation_tokens_total",
            "ray_peagle_spec_decode_num_drafts_total", "ray_peagle_spec_decode_num_draft_tokens_total",
            "ray_peagle_spec_decode_num_accepted_tokens_total", "ray_peagle_spec_decode_acceptance_length",
            "ray_peagle_speculation_depth", "ray_peagle_kv_blocks_used", "ray_peagle_kv_blocks_capacity",
            "ray_peagle_requests_running", "ray_peagle_requests_waiting", "ray_peagle_http_requests_total"}

    missing: list = []

    def ready():
        samples = _scrape(cluster["metrics"])
        names = {n for n, _, _ in samples}
        drafts = sum(v for n, _, v in samples if n == "ray_peagle_spec_decode_num_drafts_total")
        missing[:] = sorted(need - names) + ([] if drafts > 0 else ["drafts > 0"])
        return samples if not missing else None
    try:
        samples = _wait(ready, 40, "peagle metrics on the Prometheus endpoint", interval=1.0)
    except AssertionError:
        raise AssertionError(f"metrics missing from {cluster['metrics']}: {missing}") from None
    by = lambda name: [(lab, v) for n, lab, v in samples if n == name]
    # every live replica exports its capacity (Ray's exporter keeps a replaced replica's last gauge a while)
    assert {lab["replica"] for lab, _ in by("ray_peagle_kv_blocks_capacity")} >= set(
        r["replica_id"] for r in _stats(cluster)["replicas"])
    assert all(v > 0 for _, v in by("ray_peagle_kv_blocks_capacity"))
    per_pos = by("ray_peagle_spec_decode_num_accepted_tokens_per_pos_total")
    accepted = sum(v for _, v in by("ray_peagle_spec_decode_num_accepted_tokens_total"))
    assert sum(v for _, v in per_pos) == accepted  # per-position counts add up to the total
    assert all(lab["position"].isdigit() for lab, _ in per_pos)
    statuses = {lab["status"] for lab, _ in by("ray_peagle_http_requests_total")}
    assert {"200", "400", "404"} <= statuses


def test_stats_endpoint_aggregates_replicas(cluster):
    s = _stats(cluster)
    assert s["num_replicas"] == 2 and len(s["replicas"]) == 2
    spec = s["spec"]
    assert spec["num_drafts"] > 0
    assert spec["acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    assert spec["num_drafts"] == sum(r["engine"]["spec"]["num_drafts"] for r in s["replicas"])


def test_spans_link_router_replica_and_engine_across_processes(cluster, client):
    from ray import serve

    done = client.completions.create(model="tiny", prompt="trace", max_tokens=6)
    router_spans = serve.get_app_handle("peagle").debug_spans.remote().result()
    router = next(s for s in router_spans
                  if s["name"] == "router.completion" and s["attributes"].get("gen_ai.request.id") == done.id)
    engine_handle = serve.get_deployment_handle("EngineReplica", app_name="peagle")
    replica_spans = {}
    for _ in range(20):  # calls land on either replica; collect both
        for s in engine_handle.debug_spans.remote().result():
            replica_spans[s["span_id"]] = s
    replica = next(s for s in replica_spans.values()
                   if s["name"] == "replica.generate" and s["attributes"].get("gen_ai.request.id") == done.id)
    engine = next(s for s in replica_spans.values() if s["parent_id"] == replica["span_id"])
    assert replica["trace_id"] == router["trace_id"] == engine["trace_id"]
    assert replica["parent_id"] == router["span_id"] and engine["name"] == "engine.generate"
    assert engine["attributes"]["gen_ai.usage.completion_tokens"] == done.usage.completion_tokens
    assert "peagle.spec.acceptance_length" in engine["attributes"]
