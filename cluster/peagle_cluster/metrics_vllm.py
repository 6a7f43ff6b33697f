"""`GET /metrics` on the serving port: Prometheus text with vLLM's metric names and `model_name` label.

Ray's LLM dashboard, `vllm bench serve` and users' alerts query vLLM's names, so the router exports them
itself (Ray's own exporter, on another port, keeps the `ray_peagle_*` series). Request counters and
latency histograms count the requests this router answered; the engine gauges (running, waiting, KV
usage) are the cluster's, read from the stats board when a scrape comes. With several router replicas,
Serve's proxy sends each scrape to one of them: scrape each router, or read the cluster from Ray's port.

Also the per-request `metrics.speculative_decoding` object in vLLM's shape (its
`--per-request-spec-decode-metrics summary`).
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# vLLM's buckets, so dashboards' bucket-based quantiles read the same
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class VLLMMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model = model_name
        m = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the engines' running batches", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a batch slot", m, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 is full", m, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", m, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests", m + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Request arrival to its first token", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request arrival to its last token", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Between a request's steps that emitted tokens "
                             "(one observation a step, however many tokens it accepted)", m, buckets=ITL_BUCKETS,
                             registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "A request's decode time per output "
                              "token after the first", m, buckets=ITL_BUCKETS, registry=r)
        self.phases = {name: Histogram(f"vllm:request_{name}_time_seconds", f"A request's {what}", m,
                                       buckets=LATENCY_BUCKETS, registry=r)
                       for name, what in (("queue", "time waiting for a batch slot in the engine"),
                                          ("prefill", "time from its first step to its first token"),
                                          ("decode", "time from its first token to its last"),
                                          ("inference", "time from its first step to its last token"))}
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Prompt tokens a request", m,
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.generation_len = Histogram("vllm:request_generation_tokens", "Generated tokens a request", m,
                                        buckets=TOKEN_BUCKETS, registry=r)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Verify steps that carried drafts", m, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", m, registry=r)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", m, registry=r)
        self.accepted_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted at each draft position", m + ["position"], registry=r)
        # vLLM's prefix-cache counters count prompt tokens: looked up, and found cached
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", m,
                                     registry=r)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", m, registry=r)

    def observe_step_gap(self, seconds: float) -> None:
        """Between two deltas of one request that carried tokens (the router sees one a step)."""
        self.itl.labels(model_name=self.model).observe(seconds)

    def observe(self, ttft_s: float | None, e2e_s: float, prompt_tokens: int, completion_tokens: int,
                finish_reason: str | None, spec: dict[str, Any] | None, phases: dict[str, float] | None = None,
                cached_tokens: int = 0) -> None:
        """One finished request."""
        label = {"model_name": self.model}
        for name, seconds in (phases or {}).items():
            self.phases[name].labels(**label).observe(seconds)
        if ttft_s is not None and completion_tokens > 1:
            self.tpot.labels(**label).observe((e2e_s - ttft_s) / (completion_tokens - 1))
        self.prompt_len.labels(**label).observe(prompt_tokens)
        self.generation_len.labels(**label).observe(completion_tokens)
        self.prompt_tokens.labels(**label).inc(prompt_tokens)
        self.cache_queries.labels(**label).inc(prompt_tokens)
        self.cache_hits.labels(**label).inc(cached_tokens)
        self.generation_tokens.labels(**label).inc(completion_tokens)
        self.success.labels(finished_reason=finish_reason or "stop", **label).inc()
        if ttft_s is not None:
            self.ttft.labels(**label).observe(ttft_s)
        self.e2e.labels(**label).observe(e2e_s)
        if spec:
            self.drafts.labels(**label).inc(spec["num_drafts"])
            self.draft_tokens.labels(**label).inc(spec["num_draft_tokens"])
            self.accepted.labels(**label).inc(spec["num_accepted_tokens"])
            for pos, n in enumerate(spec["num_accepted_tokens_per_pos"]):
                self.accepted_pos.labels(position=str(pos), **label).inc(n)

    def render(self, cluster: dict[str, Any] | None) -> bytes:
        """The exposition text; `cluster` is the stats board's aggregate (engine gauges)."""
        if cluster is not None:
            label = {"model_name": self.model}
            self.running.labels(**label).set(cluster.get("num_running", 0))
            self.waiting.labels(**label).set(cluster.get("num_waiting", 0))
            total = cluster.get("kv_blocks_total") or 0
            self.kv_usage.labels(**label).set((cluster.get("kv_blocks_used") or 0) / total if total else 0.0)
        return generate_latest(self.registry)


def speculative_decoding(spec: dict[str, Any] | None, num_spec_tokens: int) -> dict[str, Any] | None:
    """vLLM's per-request `metrics.speculative_decoding`; None without speculation.

    `acceptance_histogram[j]` counts the verify steps that accepted exactly j drafts: steps that accepted at
    least j are `num_accepted_tokens_per_pos[j - 1]` (all steps for j = 0), so exactly j is the difference."""
    if spec is None or num_spec_tokens <= 0:
        return None
    steps, per_pos = spec["num_drafts"], list(spec["num_accepted_tokens_per_pos"])
    per_pos += [0] * (num_spec_tokens - len(per_pos))
    at_least = [steps] + per_pos + [0]
    return {"mean_acceptance_length": 1.0 + spec["num_accepted_tokens"] / steps if steps else 1.0,
            "draft_acceptance_rate": spec["num_accepted_tokens"] / spec["num_draft_tokens"]
            if spec["num_draft_tokens"] else 0.0,
            "acceptance_histogram": [at_least[j] - at_least[j + 1] for j in range(num_spec_tokens + 1)],
            "num_spec_steps": steps, "num_accepted_draft_tokens": spec["num_accepted_tokens"],
            "num_draft_tokens": spec["num_draft_tokens"], "num_spec_tokens": num_spec_tokens}
