"""End to end: a short headless Locust run against the real tiny cluster (`serve run configs/tiny.yaml`).

The cluster is shared with other cluster tests when conftest provides one (a fixture named
`tiny_cluster_url`, or `tiny_cluster` giving a URL string, a dict with "url" (and "api_key"), or an object with `.url`);
otherwise this module starts its own copy of configs/tiny.yaml on a free 127.0.0.1 port.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle_loadtest import launch, sweep
from peagle_loadtest.stats import read_records, summarize

REPO = Path(__file__).resolve().parent.parent
# Another serve config can be load-tested the same way (e.g. on a GPU box): PEAGLE_LOADTEST_CONFIG=...
TINY = Path(os.environ.get("PEAGLE_LOADTEST_CONFIG") or REPO / "configs" / "tiny.yaml")

pytestmark = pytest.mark.slow


def _shared_cluster(request) -> tuple[str, str] | None:
    """(url, api key) of a cluster fixture other tests already hold, if conftest offers one."""
    for name in ("tiny_cluster_url", "tiny_cluster"):
        try:
            value = request.getfixturevalue(name)
        except pytest.FixtureLookupError:
            continue
        if isinstance(value, str):
            url, key = value, ""
        elif isinstance(value, dict):
            url, key = value.get("url") or value.get("base_url"), value.get("api_key") or ""
        else:
            url = getattr(value, "url", None) or getattr(value, "base_url", None)
            key = getattr(value, "api_key", None) or ""
        if url:
            return str(url).rstrip("/"), key
    return None


@pytest.fixture(scope="module")
def cluster_url(request, tmp_path_factory):
    shared = _shared_cluster(request)
    if shared:
        yield shared
        return
    if not TINY.exists():
        pytest.skip(f"{TINY} is not there yet")
    cfg = launch.load_serve_config(TINY)
    d = tmp_path_factory.mktemp("tiny_cluster")
    port = sweep.free_port()
    path = launch.write_mode_config(cfg, launch.base_speculative_config(cfg), d / "tiny.yaml", port=port)
    url = f"http://127.0.0.1:{port}"
    with launch.ServeProcess(["serve", "run", str(path)], url, d / "serve.log", startup_timeout_s=300,
                             stop_timeout_s=60, cwd=REPO):
        yield url, ""


def test_headless_locust_run_against_tiny_cluster(cluster_url, tmp_path):
    url, api_key = cluster_url
    workload = "mtbench"
    try:
        from peagle_loadtest.workloads import dataset_file

        dataset_file("mtbench")
    except RuntimeError:
        workload = "synthetic"
    cmd = [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"), "--headless",
           "--only-summary", "-u", "2", "-r", "2", "-t", "15s", "--stop-timeout", "60", "--host", url,
           "--csv", str(tmp_path / "run"), "--json-file", str(tmp_path / "final"),
           "--records-file", str(tmp_path / "records.jsonl"), "--workload", workload, "--max-tokens", "32",
           "--temperature", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO), "PEAGLE_API_KEY": api_key})
    assert r.returncode == 0, r.stderr[-4000:]

    recs = read_records(tmp_path / "records.jsonl")
    assert len(recs) >= 2 and all(x.ok for x in recs), [x.error for x in recs if not x.ok]
    assert all(x.usage_reported and 1 <= x.output_tokens <= 32 for x in recs)
    assert all(0 < x.ttft_ms <= x.e2el_ms for x in recs)
    with_tpot = [x for x in recs if x.tpot_ms is not None]
    assert with_tpot and all(x.tpot_ms > 0 for x in with_tpot)

    final = {(e["method"], e["name"]): e for e in json.loads((tmp_path / "final.json").read_text())}
    assert final[("POST", "/v1/chat/completions")]["num_failures"] == 0
    assert final[("METRIC", "ttft")]["num_requests"] == len(recs)
    assert final[("METRIC", "tpot")]["num_requests"] == len(with_tpot)
    stats_csv = (tmp_path / "run_stats.csv").read_text()
    assert "METRIC,ttft" in stats_csv and "METRIC,tpot" in stats_csv

    s = summarize(recs)
    assert s["completed"] == len(recs) and s["output_throughput"] > 0
    assert s["median_tpot_ms"] > 0 and s["p99_ttft_ms"] >= s["median_ttft_ms"]
