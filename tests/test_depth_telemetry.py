"""Depth-policy observability: the chosen k, its inputs and predicted vs realised tokens reach the
replica's metrics, and each request's mean depth and acceptance reach its engine span (in-process,
no Ray, as in test_cluster_app)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from peagle_cluster.replica import EngineServer
from peagle_cluster.settings import parse_app_args
from peagle_cluster.telemetry import ReplicaMetrics, finished_spans, speculation_span_attributes
from peagle_core import LLM, SamplingParams
from peagle_core.depth.policy import DepthPolicy, StepInfo, StepOutcome


class Cycle(DepthPolicy):
    """k = 2, 0, 3, 1, 2, 0, ... (k = 0 steps included), remembering each decode step's k."""

    def __init__(self):
        self.i, self.chosen = 0, []

    def choose(self, info: StepInfo) -> int:
        k = [2, 0, 3, 1][self.i % 4]
        self.i += 1
        return min(k, info.max_k)

    def observe(self, info: StepInfo, outcome: StepOutcome) -> None:
        super().observe(info, outcome)
        if info.num_verify:
            self.chosen.append(outcome.k)


def test_span_mean_depth_counts_steps_at_k0_and_matches_the_engine(tiny_pair):
    llm = LLM(tiny_pair["target"], device="cpu", speculative_config={
        "method": "eagle3", "model": tiny_pair["peagle"], "num_speculative_tokens": 3, "parallel_drafting": True})
    pol = llm.engine.policy = Cycle()
    out = llm.generate([list(range(10, 25))], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    s = out.spec_decode_stats
    attrs = speculation_span_attributes(s, out.metrics["num_steps"])
    decode_steps = llm.engine.num_steps - 1  # one request: every step but the prefill decoded it
    assert attrs["peagle.spec.decode_steps"] == decode_steps == len(pol.chosen)
    assert 0 in pol.chosen and s.num_draft_tokens > 0
    assert attrs["peagle.spec.mean_depth"] == pytest.approx(s.num_draft_tokens / decode_steps)
    assert attrs["peagle.spec.mean_depth_verifying"] == pytest.approx(s.num_draft_tokens / s.num_drafts)
    assert attrs["peagle.spec.acceptance_rate"] == pytest.approx(s.num_accepted_tokens / s.num_draft_tokens)
    # The policy's tally saw the same steps: its k histogram is the chosen sequence.
    d = pol.describe()
    assert d["steps"] == len(pol.chosen) and d["depth_sum"] == sum(pol.chosen)
    assert {k: d.get(f"steps_at_k.{k}", 0) for k in range(4)} == {k: pol.chosen.count(k) for k in range(4)}
    # tokens per request-step: every decode step emitted accepted + 1 tokens for this request
    assert sum(n * c for n, c in ((int(k.split(".")[1]), v) for k, v in d.items()
                                  if k.startswith("tokens_per_verify."))) == len(out.outputs[0].token_ids) - 1


def test_poll_exports_policy_inputs_and_tallies():
    m = ReplicaMetrics("tiny", "r0")
    policy = {"k": 3.0, "batch": 4.0, "predicted_tokens_per_step": 6.0, "predicted_step_s": 0.02,
              "predicted_tokens_per_s": 300.0, "accept_rate_1": 0.5, "accept_rate_2": 0.25,
              "steps": 10.0, "depth_sum": 25.0, "steps_at_k.2": 5.0, "steps_at_k.3": 5.0, "realized_tokens": 50.0,
              "step_seconds": 0.2, "predicted_steps": 10.0, "predicted_tokens": 60.0, "predicted_step_seconds": 0.25,
              "tokens_per_verify.1": 20.0, "tokens_per_verify.2": 10.0, "tokens_per_verify.3": 5.0,
              "explored_steps": 2.0, "explored": 1.0, "sustained_batch": 3.0, "prompt_tokens_per_output_token": 2.5}
    m.poll({"speculation_depth": 3, "policy": policy})
    snap = m.snapshot()
    assert snap["speculation_steps_total.2"] == snap["speculation_steps_total.3"] == 5
    assert snap["speculation_depth_mean"] == 2.5
    assert snap["speculation_realized_tokens_per_step"] == 5.0
    assert snap["speculation_predicted_tokens_per_step"] == 6.0
    assert snap["speculation_predicted_step_seconds"] == pytest.approx(0.025)
    assert snap["speculation_measured_step_seconds"] == pytest.approx(0.02)
    assert snap["speculation_policy_batch_size"] == 4.0
    assert snap["speculation_sustained_batch_size"] == 3.0
    assert snap["speculation_prompt_tokens_per_output_token"] == 2.5
    assert snap["speculation_acceptance_estimate.2"] == 0.25
    assert snap["tokens_per_request_step.1"] == 20
    assert snap["speculation_explored_steps_total"] == 2
    # A second poll exports differences and interval means, not the totals again.
    later = dict(policy, steps=14.0, depth_sum=29.0, **{"steps_at_k.1": 4.0}, realized_tokens=58.0,
                 explored_steps=3.0)
    m.poll({"speculation_depth": 1, "policy": later})
    snap = m.snapshot()
    assert snap["speculation_explored_steps_total"] == 3  # counted by difference, like the steps
    assert snap["speculation_steps_total.1"] == 4 and snap["speculation_steps_total.2"] == 5
    assert snap["speculation_depth_mean"] == 1.0 and snap["speculation_realized_tokens_per_step"] == 2.0


ARGS = {"model": "tiny", "device": "cpu", "dtype": "float32", "max_num_seqs": 4, "max_model_len": 256,
        "speculative_config": {"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": 3,
                               "parallel_drafting": True, "depth_policy": "adaptive"},
        "tracing": {"exporter": "memory"}, "metrics_interval_s": 0.1}


def test_replica_exports_depth_metrics_and_span_attributes():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(120)  # noqa: E731

    async def make():
        return EngineServer(parse_app_args(ARGS).model_dump(), replica_id="depth-replica")

    srv = run(make())
    try:
        async def go():
            req = {"request_id": "depth-1", "kind": "completion", "prompt": "The speculation depth",
                   "sampling": {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}, "max_tokens": 16,
                   "trace": {}, "sent_at": time.time()}
            events = [e async for e in srv.generate(req)]
            await asyncio.sleep(0.4)  # a few poll intervals
            return events, srv.metrics.snapshot(), await srv.stats()
        events, snap, stats = run(go())
    finally:
        srv.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    assert events[-1]["event"] == "final"
    policy = stats["engine"]["policy"]
    assert policy["steps"] > 0
    # metrics: the chosen k by step (counter by k), the policy's inputs and predicted vs realised tokens
    by_k = {k.split(".")[1]: v for k, v in snap.items() if k.startswith("speculation_steps_total.")}
    assert sum(by_k.values()) == policy["steps"]
    assert all(0 <= int(k) <= 3 for k in by_k)
    for key in ("speculation_acceptance_estimate.1", "speculation_acceptance_estimate.3",
                "speculation_predicted_tokens_per_step", "speculation_realized_tokens_per_step",
                "speculation_predicted_step_seconds", "speculation_measured_step_seconds",
                "speculation_policy_batch_size", "speculation_depth_mean", "speculation_sustained_batch_size",
                "speculation_prompt_tokens_per_output_token"):
        assert key in snap, key
    assert 0 <= snap["speculation_acceptance_estimate.1"] <= 1
    assert sum(v for k, v in snap.items() if k.startswith("tokens_per_request_step.")) == policy["steps"]
    # span: the request's mean depth over its decode steps and its acceptance
    spans = finished_spans()
    replica = next(s for s in spans if s["name"] == "replica.generate"
                   and s["attributes"].get("gen_ai.request.id") == "depth-1")
    a = next(s for s in spans if s["name"] == "engine.generate" and s["parent_id"] == replica["span_id"])["attributes"]
    assert 0 <= a["peagle.spec.mean_depth"] <= 3
    # the only request: its decode steps are the engine's
    assert a["peagle.spec.decode_steps"] == policy["steps"]
    # its drafts per step are the chosen k, except where max_tokens left room for fewer
    assert a["peagle.spec.mean_depth"] <= policy["depth_sum"] / policy["steps"] + 1e-9
    if a.get("peagle.spec.num_draft_tokens"):
        assert 0 <= a["peagle.spec.acceptance_rate"] <= 1
