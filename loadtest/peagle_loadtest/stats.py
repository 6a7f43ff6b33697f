"""Summaries of per-request records, named and defined as `vllm bench serve` reports them.

Per request: ttft, tpot = (e2el - ttft) / (output_tokens - 1) (only for output_tokens > 1), e2el.
ITL is pooled over every chunk gap of every request. For each of ttft/tpot/itl/e2el the summary has
mean_<m>_ms, median_<m>_ms, std_<m>_ms and p<q>_<m>_ms (numpy's linear percentiles, as vLLM).
Throughputs divide by the benchmark duration: first request sent to last request finished.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from peagle_loadtest.stream import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50, 90, 99)


def read_records(path: str | Path) -> list[RequestRecord]:
    """Records from a JSON-lines file; a line cut short by a killed writer is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(RequestRecord.from_json(json.loads(line)))
        except (ValueError, TypeError):
            continue
    return out


def _distribution(name: str, values: list[float], percentiles: Iterable[float]) -> dict[str, float | None]:
    arr = np.asarray(values, dtype=float)
    empty = arr.size == 0
    d: dict[str, float | None] = {
        f"mean_{name}_ms": None if empty else float(arr.mean()),
        f"median_{name}_ms": None if empty else float(np.median(arr)),
        f"std_{name}_ms": None if empty else float(arr.std()),
    }
    for q in percentiles:
        key = f"p{q:g}_{name}_ms".replace(".", "_")
        d[key] = None if empty else float(np.percentile(arr, q))
    return d


def summarize(records: list[RequestRecord], *, duration_s: float | None = None,
              percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """vLLM-style benchmark metrics over completed (ok) requests; failures are counted, not timed."""
    percentiles = tuple(percentiles)
    ok = [r for r in records if r.ok]
    if duration_s is None:
        if records:
            start = min(r.start_time for r in records)
            end = max(r.start_time + r.e2el_ms / 1000 for r in records)
            duration_s = max(end - start, 1e-9)
        else:
            duration_s = 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + in_tokens),
        "usage_reported": all(r.usage_reported for r in ok) if ok else None,
    }
    series = {
        "ttft": [r.ttft_ms for r in ok if r.ttft_ms is not None],
        "tpot": [r.tpot_ms for r in ok if r.tpot_ms is not None],
        "itl": [g for r in ok for g in r.itl_ms],
        "e2el": [r.e2el_ms for r in ok],
    }
    for name in METRICS:
        summary.update(_distribution(name, series[name], percentiles))
    with_spec = [r for r in ok if r.spec_num_drafts is not None]
    if with_spec:  # per-request counters from the responses: exact for exactly these requests
        drafts = sum(r.spec_num_drafts for r in with_spec)
        accepted = sum(r.spec_num_accepted_tokens or 0 for r in with_spec)
        draft_tokens = sum(r.spec_num_draft_tokens or 0 for r in with_spec)
        summary["client_acceptance_length"] = 1.0 + accepted / drafts if drafts else None
        summary["client_draft_acceptance_rate"] = accepted / draft_tokens if draft_tokens else None
    errors = Counter(r.error for r in records if not r.ok)
    summary["errors"] = dict(errors.most_common(5))
    return summary
