"""Speculative-decoding counters read from the server, before and after a load-test cell.

Acceptance is a server-side fact (the client only sees bundled chunks), so like `vllm bench serve`
we read the counters before and after and take the difference:
    acceptance_length = 1 + accepted / drafts          (tokens per target forward)
    draft_acceptance_rate = accepted / draft_tokens
The source is either Prometheus text (counters whose names end in num_drafts / num_draft_tokens /
num_accepted_tokens, with or without Ray's `ray_` prefix and the `_total` suffix; samples with
different labels are summed) or a JSON object holding those keys, possibly nested, such as the
cluster's `GET /v1/stats` (cluster totals under "spec").
"""
from __future__ import annotations

import json
import re
from typing import Any

import requests

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfaINFA]+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of each spec-decode counter over all label sets; only names mentioning spec/peagle count."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name = m.group(1)
        base = name[:-len("_total")] if name.endswith("_total") else name
        if "spec" not in base and "peagle" not in base:
            continue
        for key in COUNTERS:
            if base == key or base.endswith("_" + key):
                found[key] = found.get(key, 0.0) + float(m.group(3))
    return found


def parse_json(obj: Any) -> dict[str, float]:
    """Counters from a JSON stats document: the first object (depth-first) holding num_drafts and
    num_accepted_tokens; the elements of a list (e.g. one entry per replica) are summed."""
    if isinstance(obj, dict):
        if "num_drafts" in obj and "num_accepted_tokens" in obj:
            return {k: float(obj[k]) for k in COUNTERS if isinstance(obj.get(k), (int, float))}
        for v in obj.values():
            if found := parse_json(v):
                return found
    elif isinstance(obj, list):
        total: dict[str, float] = {}
        for v in obj:
            for k, x in parse_json(v).items():
                total[k] = total.get(k, 0.0) + x
        return total
    return {}


def fetch_counters(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> dict[str, float] | None:
    """Counters at `url`, or None when it is unreachable or holds none."""
    try:
        resp = requests.get(url, timeout=timeout, headers=headers)
    except requests.RequestException:
        return None
    if resp.status_code != 200:
        return None
    text = resp.text
    try:
        found = parse_json(json.loads(text))
    except ValueError:
        found = parse_prometheus(text)
    return found if "num_drafts" in found and "num_accepted_tokens" in found else None


def acceptance(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """Acceptance figures over the interval between two readings (None where unknown)."""
    none = {"acceptance_length": None, "draft_acceptance_rate": None, "num_drafts": None,
            "num_draft_tokens": None, "num_accepted_tokens": None}
    if before is None or after is None:
        return none
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    if delta["num_drafts"] < 0:  # counters reset (server restarted): the interval is unknown
        return none
    drafts, accepted, draft_tokens = delta["num_drafts"], delta["num_accepted_tokens"], delta["num_draft_tokens"]
    return {
        "acceptance_length": 1.0 + accepted / drafts if drafts > 0 else None,
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
        "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
    }
