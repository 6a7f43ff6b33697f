"""Metrics (Ray's metrics API -> Ray dashboard / Prometheus) and OpenTelemetry tracing.

Metric names start with `peagle_`; Ray's exporter adds a `ray_` prefix, so Prometheus sees e.g.
`ray_peagle_time_to_first_token_seconds_bucket`. Every metric carries `model` and `replica` tags.

Counters for speculation are fed from the engine's cumulative `stats()` (one poll per interval,
incremented by the difference), so they count every step of every request, finished or not.
Each metric is also mirrored in a plain dict (`snapshot()`), which tests and `stats()` read without
a Prometheus scrape.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

log = logging.getLogger("peagle.cluster")

# Latency buckets (seconds): from a fast GPU decode step to a long CPU generation.
LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0]
TPOT_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]
# Tokens one request gets from one verify step (accepted drafts + 1): bucket n holds exactly n up to 8.
TOKENS_PER_VERIFY_BUCKETS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 33]


class ReplicaMetrics:
    """The engine replica's metrics; `poll(stats)` turns engine stats into gauges and counter increments."""

    def __init__(self, model: str, replica: str):
        self.tags = {"model": model, "replica": replica}
        keys = ("model", "replica")
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()
        self.running = Gauge("peagle_requests_running", "Requests in the engine's running batch", tag_keys=keys)
        self.waiting = Gauge("peagle_requests_waiting", "Requests waiting for a batch slot", tag_keys=keys)
        self.ongoing = Gauge("peagle_replica_ongoing_requests", "Requests this replica is serving", tag_keys=keys)
        self.kv_used = Gauge("peagle_kv_blocks_used", "Paged KV-cache blocks in use", tag_keys=keys)
        self.kv_total = Gauge("peagle_kv_blocks_capacity", "Paged KV-cache blocks available", tag_keys=keys)
        self.depth = Gauge("peagle_speculation_depth", "Draft tokens verified per step (k in use)", tag_keys=keys)
        self.accept_len = Gauge("peagle_spec_decode_acceptance_length",
                                "Mean tokens per verify step: 1 + accepted / drafts", tag_keys=keys)
        self.ttft = Histogram("peagle_time_to_first_token_seconds", "Arrival to first token",
                              boundaries=LATENCY_BUCKETS, tag_keys=keys)
        self.tpot = Histogram("peagle_time_per_output_token_seconds", "Decode time per output token after the first",
                              boundaries=TPOT_BUCKETS, tag_keys=keys)
        self.e2e = Histogram("peagle_e2e_request_latency_seconds", "Arrival to last token",
                             boundaries=LATENCY_BUCKETS, tag_keys=keys)
        self.queue = Histogram("peagle_request_queue_time_seconds", "Router hand-off to replica start",
                               boundaries=LATENCY_BUCKETS, tag_keys=keys)
        self.tokens_out = Counter("peagle_generation_tokens_total", "Generated tokens", tag_keys=keys)
        self.tokens_in = Counter("peagle_prompt_tokens_total", "Prompt tokens", tag_keys=keys)
        self.requests = Counter("peagle_requests_total", "Finished requests by finish reason",
                                tag_keys=keys + ("finish_reason",))
        self.drafts = Counter("peagle_spec_decode_num_drafts_total", "Verify steps that carried drafts", tag_keys=keys)
        self.draft_tokens = Counter("peagle_spec_decode_num_draft_tokens_total", "Draft tokens verified",
                                    tag_keys=keys)
        self.accepted = Counter("peagle_spec_decode_num_accepted_tokens_total", "Draft tokens accepted",
                                tag_keys=keys)
        self.accepted_pos = Counter("peagle_spec_decode_num_accepted_tokens_per_pos_total",
                                    "Draft tokens accepted at each position", tag_keys=keys + ("position",))
        self.preemptions = Counter("peagle_num_preemptions_total", "Requests preempted for KV space", tag_keys=keys)
        # Prefix caching, as vLLM's vllm:prefix_cache_queries / _hits: tokens looked up and found, hit rate = ratio
        self.prefix_queries = Counter("peagle_prefix_cache_queries_total", "Prompt tokens looked up in the prefix "
                                      "cache", tag_keys=keys)
        self.prefix_hits = Counter("peagle_prefix_cache_hits_total", "Prompt tokens found in the prefix cache",
                                   tag_keys=keys)
        self.prefix_evictions = Counter("peagle_prefix_cache_evictions_total", "Cached KV blocks evicted for "
                                        "memory", tag_keys=keys)
        self.kv_cached = Gauge("peagle_kv_blocks_cached", "KV blocks holding a cached prefix (in use or not)",
                               tag_keys=keys)
        # The depth policy (speculative decoding): the chosen k, its inputs, predicted vs realised.
        self.depth_steps = Counter("peagle_speculation_steps_total", "Decode steps by the speculation depth k chosen",
                                   tag_keys=keys + ("k",))
        self.explored_steps = Counter("peagle_speculation_explored_steps_total", "Decode steps on which the "
                                      "adaptive policy ran its runner-up k to measure it (exploration)",
                                      tag_keys=keys)
        self.depth_mean = Gauge("peagle_speculation_depth_mean", "Mean k over the decode steps of the last poll "
                                "interval", tag_keys=keys)
        self.policy_batch = Gauge("peagle_speculation_policy_batch_size", "Requests verifying in the step of the "
                                  "policy's last choice (its batch-size input)", tag_keys=keys)
        self.sustained_batch = Gauge("peagle_speculation_sustained_batch_size", "Requests the adaptive policy "
                                     "expects to decode at its chosen k: the step's batch, or fewer where the token "
                                     "budget cannot also hold the prompts coming in", tag_keys=keys)
        self.prompt_share = Gauge("peagle_speculation_prompt_tokens_per_output_token", "Prompt tokens fed per "
                                  "token emitted over the last steps (the adaptive policy's rho)", tag_keys=keys)
        self.accept_est = Gauge("peagle_speculation_acceptance_estimate", "The policy's conditional acceptance "
                                "estimate per draft position (1-based)", tag_keys=keys + ("position",))
        self.pred_tokens = Gauge("peagle_speculation_predicted_tokens_per_step", "Tokens per decode step the "
                                 "policy predicted for its choices (poll-interval mean)", tag_keys=keys)
        self.real_tokens = Gauge("peagle_speculation_realized_tokens_per_step", "Tokens per decode step emitted "
                                 "(poll-interval mean)", tag_keys=keys)
        self.pred_step = Gauge("peagle_speculation_predicted_step_seconds", "Step time the policy predicted for "
                               "its choices (poll-interval mean)", tag_keys=keys)
        self.meas_step = Gauge("peagle_speculation_measured_step_seconds", "Measured decode step time "
                               "(poll-interval mean)", tag_keys=keys)
        self.pred_goodput = Gauge("peagle_speculation_predicted_tokens_per_second", "Goodput the policy predicted "
                                  "for its last choice", tag_keys=keys)
        self.tokens_per_verify = Histogram("peagle_speculation_tokens_per_request_step", "Tokens one request "
                                           "received from one decode step (accepted drafts + 1)",
                                           boundaries=TOKENS_PER_VERIFY_BUCKETS, tag_keys=keys)
        self._last_policy: dict[str, float] = {}
        self._last: dict[str, Any] = {}
        self._touched_positions = 0
        for c in (self.drafts, self.draft_tokens, self.accepted, self.preemptions, self.tokens_out, self.tokens_in,
                  self.prefix_queries, self.prefix_hits, self.prefix_evictions):
            _touch(c, self.tags)
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_preemptions",
                     "generation_tokens_total", "prompt_tokens_total", "prefix_cache_queries", "prefix_cache_hits",
                     "prefix_cache_evictions"):
            self._values[name] = 0.0

    # -- mirror -----------------------------------------------------------------------------
    def _set(self, name: str, v: float) -> None:
        with self._lock:
            self._values[name] = float(v)

    def _add(self, name: str, v: float) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0.0) + float(v)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    # -- per request ---------------------------------------------------------------------------
    def observe_request(self, metrics: dict[str, float], finish_reason: str, queue_s: float | None) -> None:
        t = self.tags
        arrival, first, done = metrics.get("arrival_time"), metrics.get("first_token_time"), metrics.get("finished_time")
        n_out = int(metrics.get("num_generated_tokens", 0))
        if arrival is not None and first is not None:
            self.ttft.observe(max(first - arrival, 0.0), tags=t)
            self._add("ttft_count", 1)
        if first is not None and done is not None and n_out > 1:
            self.tpot.observe(max(done - first, 0.0) / (n_out - 1), tags=t)
        if arrival is not None and done is not None:
            self.e2e.observe(max(done - arrival, 0.0), tags=t)
            self._add("e2e_count", 1)
        if queue_s is not None:
            self.queue.observe(max(queue_s, 0.0), tags=t)
        if n_out:
            self.tokens_out.inc(n_out, tags=t)
            self._add("generation_tokens_total", n_out)
        n_in = int(metrics.get("num_prompt_tokens", 0))
        if n_in:
            self.tokens_in.inc(n_in, tags=t)
            self._add("prompt_tokens_total", n_in)
        self.requests.inc(1, tags=t | {"finish_reason": finish_reason or "unknown"})
        self._add(f"requests_total.{finish_reason}", 1)

    def set_ongoing(self, n: int) -> None:
        self.ongoing.set(n, tags=self.tags)
        self._set("ongoing", n)

    # -- per poll ------------------------------------------------------------------------------
    def poll(self, stats: dict[str, Any]) -> None:
        t = self.tags
        for gauge, key in ((self.running, "num_running"), (self.waiting, "num_waiting"),
                           (self.kv_used, "kv_blocks_used"), (self.kv_total, "kv_blocks_total"),
                           (self.depth, "speculation_depth"), (self.kv_cached, "kv_blocks_cached")):
            if stats.get(key) is not None:
                gauge.set(float(stats[key]), tags=t)
                self._set(key, stats[key])
        spec = stats.get("spec") or {}
        if spec.get("acceptance_length") is not None:
            self.accept_len.set(float(spec["acceptance_length"]), tags=t)
            self._set("acceptance_length", spec["acceptance_length"])
        for counter, key in ((self.drafts, "num_drafts"), (self.draft_tokens, "num_draft_tokens"),
                             (self.accepted, "num_accepted_tokens")):
            delta = int(spec.get(key, 0)) - int(self._last.get(key, 0))
            if delta > 0:
                counter.inc(delta, tags=t)
                self._add(key, delta)
        per_pos = list(spec.get("num_accepted_tokens_per_pos") or [])
        for i in range(self._touched_positions, len(per_pos)):
            _touch(self.accepted_pos, t | {"position": str(i)})
        self._touched_positions = max(self._touched_positions, len(per_pos))
        last_pos = list(self._last.get("num_accepted_tokens_per_pos") or [])
        for i, v in enumerate(per_pos):
            delta = int(v) - int(last_pos[i] if i < len(last_pos) else 0)
            if delta > 0:
                self.accepted_pos.inc(delta, tags=t | {"position": str(i)})
                self._add(f"num_accepted_tokens_per_pos.{i}", delta)
        engine_counters = ((self.preemptions, "num_preemptions"), (self.prefix_queries, "prefix_cache_queries"),
                           (self.prefix_hits, "prefix_cache_hits"), (self.prefix_evictions, "prefix_cache_evictions"))
        for counter, key in engine_counters:
            delta = int(stats.get(key, 0)) - int(self._last.get(key, 0))
            if delta > 0:
                counter.inc(delta, tags=t)
                self._add(key, delta)
        # Copies: the engine may hand out its live lists.
        self._last = {k: list(v) if isinstance(v, list) else v for k, v in spec.items()}
        self._last |= {key: stats.get(key, 0) for _, key in engine_counters}
        if stats.get("policy"):
            self._poll_policy(dict(stats["policy"]))

    def _poll_policy(self, p: dict[str, float]) -> None:
        """The depth policy's `describe()`: last-choice inputs as gauges, its cumulative tally as
        counters / a histogram (by difference) and poll-interval means."""
        t, last = self.tags, self._last_policy
        delta = {key: float(v) - float(last.get(key, 0.0)) for key, v in p.items()
                 if key.startswith(("steps_at_k.", "tokens_per_verify.")) or key in _TALLY_KEYS}
        for key, d in delta.items():
            if d <= 0:
                continue
            if key.startswith("steps_at_k."):
                self.depth_steps.inc(d, tags=t | {"k": key.split(".", 1)[1]})
                self._add(f"speculation_steps_total.{key.split('.', 1)[1]}", d)
            elif key.startswith("tokens_per_verify."):
                n = float(key.split(".", 1)[1])
                for _ in range(int(d)):  # one observation per request-step, exactly as counted
                    self.tokens_per_verify.observe(n, tags=t)
                self._add(f"tokens_per_request_step.{key.split('.', 1)[1]}", d)
            elif key == "explored_steps":
                self.explored_steps.inc(d, tags=t)
                self._add("speculation_explored_steps_total", d)

        def interval_mean(num: str, den: str) -> float | None:
            n, m = delta.get(num, 0.0), delta.get(den, 0.0)
            return n / m if m > 0 else None

        gauges = {
            "speculation_depth_mean": (self.depth_mean, interval_mean("depth_sum", "steps")),
            "speculation_realized_tokens_per_step": (self.real_tokens, interval_mean("realized_tokens", "steps")),
            "speculation_predicted_tokens_per_step": (self.pred_tokens,
                                                      interval_mean("predicted_tokens", "predicted_steps")),
            "speculation_predicted_step_seconds": (self.pred_step,
                                                   interval_mean("predicted_step_seconds", "predicted_steps")),
            "speculation_measured_step_seconds": (self.meas_step, interval_mean("step_seconds", "steps")),
            "speculation_policy_batch_size": (self.policy_batch, p.get("batch")),
            "speculation_sustained_batch_size": (self.sustained_batch, p.get("sustained_batch")),
            "speculation_prompt_tokens_per_output_token": (self.prompt_share, p.get("prompt_tokens_per_output_token")),
            "speculation_predicted_tokens_per_second": (self.pred_goodput, p.get("predicted_tokens_per_s")),
        }
        for name, (gauge, v) in gauges.items():
            if v is not None:
                gauge.set(float(v), tags=t)
                self._set(name, v)
        for key, v in p.items():
            if key.startswith("accept_rate_"):
                pos = key[len("accept_rate_"):]
                self.accept_est.set(float(v), tags=t | {"position": pos})
                self._set(f"speculation_acceptance_estimate.{pos}", v)
        self._last_policy = p


_TALLY_KEYS = ("steps", "depth_sum", "realized_tokens", "step_seconds", "predicted_steps", "predicted_tokens",
               "predicted_step_seconds", "explored_steps")


def speculation_span_attributes(spec: Any, num_steps: int | None) -> dict[str, float | int]:
    """A request's depth and acceptance for its engine span, from its `SpecDecodeStats` and the engine's count of
    the steps that emitted tokens for it (`num_steps` in its metrics).

    The request's stats count only steps that verified drafts, so `peagle.spec.mean_depth` (k averaged over all
    its decode steps, k = 0 included) takes the decode-step count from the engine: every step that emitted tokens
    for it but the first, whose token came from the prompt. (A preempted request's recompute also emits a token:
    it counts as a step at k = 0.)
    """
    out: dict[str, float | int] = {}
    if spec is None:
        return out
    if spec.num_draft_tokens:
        out["peagle.spec.acceptance_rate"] = spec.num_accepted_tokens / spec.num_draft_tokens
    if spec.num_drafts:
        out["peagle.spec.mean_depth_verifying"] = spec.num_draft_tokens / spec.num_drafts
    if num_steps:
        steps = int(num_steps) - 1
        if steps > 0:
            out["peagle.spec.decode_steps"] = steps
            out["peagle.spec.mean_depth"] = spec.num_draft_tokens / steps
    return out


def _touch(counter: Counter, tags: dict[str, str]) -> None:
    """Export a counter at 0 before its first increment, so dashboards show 0 rather than "no data"
    (e.g. accepted tokens of a drafter that has accepted none yet). Ray's public `inc` refuses 0."""
    try:
        counter._record(0.0, tags=tags)
    except Exception:
        pass


class RouterMetrics:
    """HTTP-level counters and end-to-end latency as the client sees it (incl. routing and queueing)."""

    def __init__(self, model: str):
        self.model = model
        self.requests = Counter("peagle_http_requests_total", "HTTP requests by route and status",
                                tag_keys=("model", "route", "status"))
        self.latency = Histogram("peagle_http_request_latency_seconds", "Router receive to last byte",
                                 boundaries=LATENCY_BUCKETS, tag_keys=("model", "route"))
        self.rejected = Counter("peagle_backpressure_rejections_total", "Requests refused with 503 (queue full)",
                                tag_keys=("model",))

    def observe(self, route: str, status: int, seconds: float | None = None) -> None:
        self.requests.inc(1, tags={"model": self.model, "route": route, "status": str(status)})
        if seconds is not None:
            self.latency.observe(seconds, tags={"model": self.model, "route": route})


# --------------------------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------------------------

_tracing_lock = threading.Lock()
_memory_exporter = None
_configured = False


def setup_tracing(exporter: str = "auto", service_name: str = "peagle") -> None:
    """Install a tracer provider for this process once (each Ray actor calls it in its constructor)."""
    global _configured, _memory_exporter
    with _tracing_lock:
        if _configured:
            return
        _configured = True
        if exporter == "auto":
            has_endpoint = any(os.environ.get(k) for k in ("OTEL_EXPORTER_OTLP_ENDPOINT",
                                                          "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
            exporter = "otlp" if has_endpoint else "none"
        if exporter == "none":
            return  # the API's default no-op tracer: spans cost next to nothing
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporter == "memory":
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

            _memory_exporter = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(_memory_exporter))
        elif exporter == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:  # otlp over HTTP/protobuf; endpoint, headers and timeouts come from the standard OTEL_* variables
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        log.info("tracing: exporting spans via %s", exporter)


def tracer():
    from opentelemetry import trace

    return trace.get_tracer("peagle.cluster")


def inject_context(span=None) -> dict[str, str]:
    """`span` (default: the current one) as W3C `traceparent` headers, to carry across the handle."""
    from opentelemetry import trace
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)
    return carrier


def extract_context(carrier: dict[str, str] | None):
    from opentelemetry.propagate import extract

    return extract(carrier or {})


def finished_spans() -> list[dict[str, Any]]:
    """Spans held by the in-memory exporter, as plain dicts (picklable across Ray)."""
    if _memory_exporter is None:
        return []
    out = []
    for s in _memory_exporter.get_finished_spans():
        out.append({"name": s.name, "trace_id": f"{s.context.trace_id:032x}", "span_id": f"{s.context.span_id:016x}",
                    "parent_id": f"{s.parent.span_id:016x}" if s.parent else None,
                    "attributes": dict(s.attributes or {}), "status": s.status.status_code.name})
    return out
