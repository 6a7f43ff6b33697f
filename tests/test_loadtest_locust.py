"""The Locust user and the sweep, run as subprocesses against the fake OpenAI server.

The fake's timing is scripted (TTFT, chunk gap, tokens per chunk), so the figures Locust reports
have an oracle; its faults check that every kind of bad answer counts as a failure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from peagle_loadtest import sweep
from peagle_loadtest.fake_server import FakeBehavior, FakeServerThread
from peagle_loadtest.stats import read_records

REPO = Path(__file__).resolve().parent.parent
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"


def run_locust(host: str, out: Path, *args: str, users: int = 2, seconds: int = 4, timeout: int = 60):
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary", "-u", str(users),
           "-r", str(users), "-t", f"{seconds}s", "--host", host, "--csv", str(out / "run"),
           "--json-file", str(out / "final"), "--records-file", str(out / "records.jsonl"), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=out, env=env)


def final_stats(out: Path) -> dict[tuple[str, str], dict]:
    return {(e["method"], e["name"]): e for e in json.loads((out / "final.json").read_text())}


def test_locust_reports_llm_metrics(tmp_path):
    b = FakeBehavior(ttft_ms=40, chunk_ms=15, tokens_per_chunk=3)
    with FakeServerThread(b) as srv:
        r = run_locust(srv.url, tmp_path, "--max-tokens", "30", "--workload", "synthetic",
                       "--synthetic-input-len", "16", "--temperature", "0.7")
        bodies = list(srv.fake.bodies)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = read_records(tmp_path / "records.jsonl")
    assert len(recs) >= 4 and all(x.ok for x in recs)
    assert all(x.output_tokens == 30 and x.usage_reported for x in recs)

    st = final_stats(tmp_path)
    http = st[("POST", "/v1/chat/completions")]
    assert http["num_failures"] == 0 and http["num_requests"] == len(recs)
    for name in ("ttft", "tpot", "e2el", "output_tokens"):
        assert st[("METRIC", name)]["num_requests"] == len(recs), name
    assert st[("METRIC", "itl")]["num_requests"] == 9 * len(recs)  # 10 chunks of 3 tokens per answer
    # Locust's figures are the records' figures (its mean is exact; its percentiles are rounded)
    mean = lambda e: e["total_response_time"] / e["num_requests"]
    assert mean(st[("METRIC", "tpot")]) == pytest.approx(np.mean([x.tpot_ms for x in recs]))
    assert mean(st[("METRIC", "ttft")]) == pytest.approx(np.mean([x.ttft_ms for x in recs]))
    assert mean(st[("METRIC", "output_tokens")]) == 30
    # the HTTP entry's time is the whole stream (not time to headers)
    assert mean(http) == pytest.approx(np.mean([x.e2el_ms for x in recs]))
    # oracle from the script: TTFT >= 40 ms; a chunk every ~15 ms carrying 3 tokens -> TPOT ~ ITL / 3
    tpot, itl = np.median([x.tpot_ms for x in recs]), np.median([g for x in recs for g in x.itl_ms])
    assert np.median([x.ttft_ms for x in recs]) >= 39
    assert 14 <= itl <= 60
    assert tpot == pytest.approx(itl * 9 / 29, rel=0.25)
    # what was sent: the model from GET /v1/models, usage requested, the CLI's options
    assert bodies[0]["model"] == "fake-model" and bodies[0]["stream_options"] == {"include_usage": True}
    assert bodies[0]["max_tokens"] == 30 and bodies[0]["temperature"] == 0.7
    assert len(bodies[0]["messages"][0]["content"].split()) == 16
    assert (tmp_path / "run_stats.csv").read_text().count("METRIC") >= 5


def test_locust_counts_bad_answers_as_failures(tmp_path):
    faults = ["ok", "http500", "error_event", "empty", "no_done"]
    with FakeServerThread(FakeBehavior(ttft_ms=5, chunk_ms=2, faults=faults)) as srv:
        r = run_locust(srv.url, tmp_path, "--max-tokens", "4", "--endpoint", "completions", users=1, seconds=3)
    assert r.returncode == 1, r.stderr[-3000:]  # Locust's exit code when requests failed
    recs = read_records(tmp_path / "records.jsonl")
    ok = [x for x in recs if x.ok]
    assert len(recs) >= 10
    assert len(ok) == pytest.approx(len(recs) / 5, abs=1)  # one user: the faults come in order
    errors = {x.error for x in recs if not x.ok}
    assert errors == {"HTTP 500: scripted failure", "server error: scripted mid-stream failure",
                      "empty answer (no content in any chunk)", "stream ended without 'data: [DONE]'"}
    st = final_stats(tmp_path)
    http = st[("POST", "/v1/completions")]
    assert http["num_requests"] == len(recs) and http["num_failures"] == len(recs) - len(ok)
    assert st[("METRIC", "ttft")]["num_requests"] == len(ok)  # failures are not timed


def test_locust_rejects_bad_options_before_starting(tmp_path):
    r = run_locust("http://127.0.0.1:9", tmp_path, "--max-tokens", "0", seconds=2)
    assert r.returncode == 2
    assert "--max-tokens must be at least 1" in r.stderr and "Traceback" not in r.stderr


def test_sweep_two_modes_two_concurrencies(tmp_path):
    """No speculation vs 3 tokens per chunk: same chunk time, so ~3x less TPOT and more throughput,
    and the acceptance length read from /metrics is exactly 3."""
    slow = FakeBehavior(ttft_ms=20, chunk_ms=10, tokens_per_chunk=1, slowdown_per_active=0.05)
    fast = FakeBehavior(ttft_ms=20, chunk_ms=10, tokens_per_chunk=3, slowdown_per_active=0.05)
    with FakeServerThread(slow) as a, FakeServerThread(fast) as b:
        targets = [sweep.Target("none", url=a.url), sweep.Target("peagle", url=b.url)]
        load = sweep.LoadOptions(max_tokens=24, synthetic_input_len=8)
        plan = sweep.CellPlan(duration_s=2, stop_timeout_s=5)
        doc = sweep.run_sweep(targets, [1, 2], load, plan, tmp_path, warmup_requests=1, label="fake")
    cells = {(c["mode"], c["concurrency"]): c for c in doc["cells"]}
    assert set(cells) == {("none", 1), ("none", 2), ("peagle", 1), ("peagle", 2)}
    for c in cells.values():
        assert c["status"] == "ok" and c["completed"] > 0 and c["failed"] == 0
        for key in ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                    "median_itl_ms", "p50_e2el_ms", "output_throughput", "request_throughput"):
            assert c[key] is not None and c[key] > 0, key
        assert c["acceptance_source"] == "server metrics"
    for conc in (1, 2):
        none, spec = cells[("none", conc)], cells[("peagle", conc)]
        assert spec["acceptance_length"] == pytest.approx(3.0)
        assert none["acceptance_length"] == pytest.approx(1.0)
        assert spec["median_tpot_ms"] < 0.6 * none["median_tpot_ms"]
        assert spec["output_throughput"] > 1.5 * none["output_throughput"]
    assert cells[("none", 2)]["output_throughput"] > cells[("none", 1)]["output_throughput"]

    on_disk = json.loads((tmp_path / "sweep.json").read_text())
    assert len(on_disk["cells"]) == 4 and on_disk["meta"]["label"] == "fake"
    rows = (tmp_path / "sweep.csv").read_text().splitlines()
    assert len(rows) == 5 and "median_tpot_ms" in rows[0]
    for png in ("throughput_vs_concurrency.png", "tpot_vs_concurrency.png", "ttft_vs_concurrency.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    md = (tmp_path / "summary.md").read_text()
    assert "| peagle | 2 |" in md and "| none | 1 |" in md and "![tpot_vs_concurrency]" in md
    assert (tmp_path / "cells" / "peagle-c2" / "locust_stats.csv").exists()


def test_sweep_cli_starts_one_server_per_mode(tmp_path):
    """--config path: per-mode configs are written and served (here by the fake, in place of `serve run`)."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("""
http_options: {host: 0.0.0.0, port: 8000}
applications:
  - name: peagle
    import_path: peagle_cluster.app:build_app
    args:
      model: tiny
      speculative_config: {method: eagle3, model: heads/peagle, num_speculative_tokens: 4, parallel_drafting: true}
""")
    out = tmp_path / "out"
    rc = sweep.main(["--config", str(cfg), "--modes", "none,adaptive", "--concurrency", "2", "--duration", "2",
                     "--max-tokens", "12", "--stop-timeout", "5", "--startup-timeout", "30", "--out", str(out),
                     "--mode-spec", 'broken={"model": "x", "num_speculative_tokens": "not a number"}',
                     "--serve-cmd", f"{sys.executable} -m peagle_loadtest.fake_server --serve-config {{config}}"])
    assert rc == 1  # one mode's server could not start
    doc = json.loads((out / "sweep.json").read_text())
    cells = {c["mode"]: c for c in doc["cells"]}
    assert set(cells) == {"none", "adaptive", "broken"}
    assert cells["broken"]["status"].startswith("server failed: server exited with code 1")
    assert cells["none"]["status"] == cells["adaptive"]["status"] == "ok"  # the others still ran
    assert cells["none"]["acceptance_length"] == pytest.approx(1.0)
    assert cells["adaptive"]["acceptance_length"] == pytest.approx(4.0)  # the fake: 1 + K//2 + 1 per chunk
    written = (out / "configs" / "adaptive.yaml").read_text()
    assert "adaptive: true" in written and "parallel_drafting: true" in written
    assert "speculative_config" not in (out / "configs" / "none.yaml").read_text()
    assert "fake OpenAI server" in (out / "servers" / "none.log").read_text()


def test_sweep_cli_errors_are_messages(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sweep.main(["--host", "http://127.0.0.1:9", "--concurrency", "1,x"])
    assert e.value.code == 2 and "--concurrency must be a comma list" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.main(["--concurrency", "1"])
    assert "exactly one of --host, --mode-host or --config" in capsys.readouterr().err


def test_cell_is_bounded_in_time(tmp_path):
    """A server that never finishes answering: the cell ends at --cell-timeout, marked as such."""
    with FakeServerThread(FakeBehavior(ttft_ms=10, chunk_ms=60_000)) as srv:
        plan = sweep.CellPlan(duration_s=1, stop_timeout_s=120, cell_timeout_s=5)
        t0 = time.monotonic()
        cell = sweep.run_cell(srv.url, 1, sweep.LoadOptions(max_tokens=4), plan, tmp_path / "cell")
    assert time.monotonic() - t0 < 15
    assert cell["status"] == "timeout" and cell["completed"] == 0
