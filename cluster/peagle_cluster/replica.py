"""The engine replica: one AsyncLLM per Ray Serve replica, streaming deltas back to the router.

`EngineServer` is a plain class (tests drive it in-process); `EngineReplica` is the same class as a
Ray Serve deployment. `generate` is an async generator of plain dicts, so the router receives
them through `handle.options(stream=True)`:

    {"event": "delta", "text", "reasoning", "tool_calls", "num_tokens", "finish_reason"}   (0..n times;
                                                    chat: `text` is the reply's content, as the engine splits it)
    {"event": "final", "finish_reason", "usage", "spec"}                                (exactly once on success)
    {"event": "error", "status", "message", "param", "code"}                            (instead of final)

Requests arrive checked by the router (the edge); what needs the tokenizer or the engine (context length,
vocabulary) is refused here, as an `error` event before any delta (the router answers it with a 4xx);
an engine failure mid-stream becomes an `error` event after the deltas. Closing the generator
(the client went away, Serve cancelled the call) closes the engine stream, which aborts the
request and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from typing import Any, AsyncIterator

from ray import serve

from peagle_core.loading.tokenizer import today
from peagle_cluster.settings import AppSettings
from peagle_cluster.stats_board import lookup_board
from peagle_cluster.telemetry import (ReplicaMetrics, extract_context, finished_spans, setup_tracing,
                               speculation_span_attributes, tracer)

log = logging.getLogger("peagle.cluster")

# Prompts are tokenised off the event loop when longer than this (the loop also streams other requests).
_THREAD_TOKENIZE_CHARS = 4096


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"event": "error", "status": status, "message": message, "param": param, "code": code}


class EngineServer:
    def __init__(self, settings: dict[str, Any], replica_id: str | None = None):
        from peagle_core.engine.async_llm import AsyncLLM

        self._closing = False
        self._stop_polling = threading.Event()
        self.settings = AppSettings.model_validate(settings)
        setup_tracing(self.settings.tracing.exporter, self.settings.tracing.service_name + "-replica")
        self.replica_id = replica_id or _current_replica_id()
        self._limit_cpu_threads()
        t0 = time.perf_counter()
        self.llm = AsyncLLM.from_engine_args(**self.settings.engine_args)
        log.info("replica %s: engine for %s loaded in %.1fs", self.replica_id, self.llm.model_name,
                 time.perf_counter() - t0)
        self.model_name = self.settings.model_name
        self.max_model_len = int(self.llm.max_model_len)
        self.max_chars_per_token = self.settings.max_chars_per_token or _max_chars_per_token(self.llm.tokenizer)
        self.metrics = ReplicaMetrics(self.model_name, self.replica_id)
        threading.Thread(target=self._poll_forever, name="peagle-stats", daemon=True).start()
        self.ongoing = 0
        self.served = 0
        self.aborted = 0
        self.errors = 0

    # ------------------------------------------------------------------------------------------
    # Serve hooks
    # ------------------------------------------------------------------------------------------

    def check_health(self) -> None:
        """Serve calls this every `health_check_period_s`; raising marks the replica for replacement."""
        self.llm.check_health()

    def record_routing_stats(self) -> dict[str, Any]:
        """Published to Serve's request router (`RunningReplica.routing_stats`) for load-aware routing."""
        s = self.llm.stats()
        total = max(int(s.get("kv_blocks_total") or 0), 1)
        return {"ongoing": self.ongoing, "num_running": s.get("num_running", 0), "num_waiting": s.get("num_waiting", 0),
                "kv_usage": (s.get("kv_blocks_used") or 0) / total,
                "speculation_depth": s.get("speculation_depth"),
                "acceptance_length": (s.get("spec") or {}).get("acceptance_length")}

    def __del__(self) -> None:
        """Graceful shutdown: Serve has already drained requests for `graceful_shutdown_timeout_s`;
        anything still running ends now with an error event (never a silently cut stream)."""
        self.shutdown()

    def shutdown(self) -> None:
        if getattr(self, "_closing", True) or not hasattr(self, "llm"):
            return
        self._closing = True
        self._stop_polling.set()
        app = _app_name()
        board = lookup_board(app) if app is not None else None
        if board is not None:
            board.report.remote(self.replica_id, None)  # leave the board now rather than after its TTL
        try:
            self.llm.shutdown()
        except Exception:  # shutting down anyway: a failing engine must not block replica teardown
            log.exception("engine shutdown failed")

    # ------------------------------------------------------------------------------------------
    # Calls from the router
    # ------------------------------------------------------------------------------------------

    async def health(self) -> dict[str, str]:
        self.llm.check_health()
        return {"status": "ok", "replica_id": self.replica_id}

    async def info(self) -> dict[str, Any]:
        return {"model": self.model_name, "max_model_len": self.max_model_len,
                "max_chars_per_token": self.max_chars_per_token, "replica_id": self.replica_id}

    async def stats(self) -> dict[str, Any]:
        """Engine and replica counters (tests and operators read them through a deployment handle)."""
        return {"replica_id": self.replica_id, "model": self.model_name, **self._summary(self.llm.stats()),
                "metrics": self.metrics.snapshot()}

    async def debug_spans(self) -> list[dict[str, Any]]:
        return finished_spans()

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream one request. `req` is built by the router (see `peagle_cluster.router.engine_request`)."""
        rid = req.get("request_id") or uuid.uuid4().hex
        queue_s = time.time() - req["sent_at"] if req.get("sent_at") else None
        # Spans are started and ended by hand: a `with` block around `yield` would attach the span to
        # whichever context happens to resume the generator.
        span = tracer().start_span("replica.generate", context=extract_context(req.get("trace")))
        span.set_attribute("peagle.replica", self.replica_id)
        span.set_attribute("gen_ai.request.id", rid)
        span.set_attribute("gen_ai.request.model", self.model_name)
        if queue_s is not None:
            span.set_attribute("peagle.latency.time_in_serve_queue", max(queue_s, 0.0))
        try:
            if self._closing:
                yield _error(503, "This replica is shutting down; retry the request.", code="shutting_down")
                return
            try:
                prompt_ids = await self._prompt_ids(req)
                params = self._sampling_params(req, len(prompt_ids))
            except ValueError as e:
                span.set_attribute("error.type", "invalid_request")
                yield _error(400, str(e), param=getattr(e, "param", None), code=getattr(e, "code", None))
                return
            span.set_attribute("gen_ai.request.max_tokens", params.max_tokens or 0)
            span.set_attribute("gen_ai.request.temperature", float(params.temperature))
            span.set_attribute("gen_ai.request.top_p", float(params.top_p))
            # aclosing: when the router cancels, close the inner generator now (its `finally` aborts the
            # engine request) instead of whenever the garbage collector finalises it.
            async with contextlib.aclosing(self._stream(rid, req, prompt_ids, params, queue_s, span)) as events:
                async for event in events:
                    yield event
        finally:
            span.end()

    async def _stream(self, rid: str, req: dict[str, Any], prompt_ids: list[int], params, queue_s: float | None,
                      parent) -> AsyncIterator[dict[str, Any]]:
        from opentelemetry import trace

        from peagle_core.engine.async_llm import EngineDeadError, EngineError

        chat_prefix = req.get("prefill", "") if req.get("kind") == "chat" else None
        espan = tracer().start_span("engine.generate", context=trace.set_span_in_context(parent))
        self.ongoing += 1
        self.metrics.set_ongoing(self.ongoing)
        agen = self.llm.generate(prompt_ids, params, rid, chat_prefix).__aiter__()
        outcome, n_out, last = "cancelled", 0, None
        try:
            try:
                async for out in agen:
                    last = out
                    o = out.outputs[0]
                    n_out += len(o.token_ids)
                    ev = {"event": "delta", "text": o.text, "reasoning": o.reasoning or "",
                          "tool_calls": o.tool_calls or [], "num_tokens": len(o.token_ids),
                          "finish_reason": o.finish_reason}
                    if o.logprobs is not None:
                        ev["logprobs"] = self._logprob_entries(o.token_ids, o.logprobs, params.logprobs)
                    yield ev
                outcome = "ok"
            except ValueError as e:
                outcome = "error"
                if last is not None:  # not input validation: something broke mid-request
                    self.errors += 1
                    log.exception("request %s failed mid-stream", rid)
                    espan.set_attribute("error.type", "internal_error")
                    yield _error(500, "Internal error while generating this request.", code="internal_error")
                    return
                espan.set_attribute("error.type", "invalid_request")
                param = getattr(e, "param", None)
                if chat_prefix is not None and param == "prompt":
                    param = "messages"  # a chat's prompt is its rendered messages
                yield _error(400, str(e), param=param, code=getattr(e, "code", None))
                return
            except EngineDeadError as e:
                outcome = "error"
                self.errors += 1
                espan.set_attribute("error.type", "engine_dead")
                log.error("request %s: engine dead: %s", rid, e)
                yield _error(503, f"The engine on this replica stopped ({e}); the replica is being replaced. "
                                  "Retry the request.", code="engine_dead")
                return
            except EngineError as e:
                outcome = "error"
                if self._closing:  # shutdown ended the stream: retryable on another replica
                    espan.set_attribute("error.type", "shutting_down")
                    yield _error(503, "The replica shut down before this request finished; retry it.",
                                 code="shutting_down")
                    return
                self.errors += 1
                espan.set_attribute("error.type", "engine_error")
                log.error("request %s: engine error: %s", rid, e)
                yield _error(500, f"The engine failed while generating this request: {e}", code="engine_error")
                return
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as e:  # a bug: log it here, never send a traceback to the client
                outcome = "error"
                self.errors += 1
                log.exception("request %s failed", rid)
                espan.set_attribute("error.type", type(e).__name__)
                yield _error(500, "Internal error while generating this request.", code="internal_error")
                return
            finish = last.outputs[0].finish_reason if last is not None else "stop"
            metrics = dict(last.metrics) if last is not None else {}
            metrics.setdefault("num_prompt_tokens", len(prompt_ids))
            metrics.setdefault("num_generated_tokens", n_out)
            self.metrics.observe_request(metrics, finish, queue_s)
            self.served += 1
            yield {"event": "final", "finish_reason": finish,
                   "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out,
                             "cached_tokens": last.num_cached_tokens if last is not None else 0},
                   "spec": _spec_dict(last.spec_decode_stats if last is not None else None),
                   "phases": _phases(metrics)}
        finally:
            self.ongoing -= 1
            self.metrics.set_ongoing(self.ongoing)
            if last is not None:
                _span_stats(espan, last, queue_s)
            if outcome != "ok":
                # Cancelled (client gone) or failed: make sure the engine forgets the request.
                if outcome == "cancelled":
                    self.aborted += 1
                    espan.set_attribute("peagle.aborted", True)
                await _close_quietly(agen)
                try:
                    await self.llm.abort(rid)
                except Exception:
                    pass
            espan.end()

    async def _prompt_ids(self, req: dict[str, Any]) -> list[int]:
        """The prompt's ids (the router has bounded its characters); the engine checks them against its context."""
        tok = self.llm.tokenizer
        if req.get("kind") == "chat":
            text = self._chat_text(req)
        elif isinstance(req["prompt"], str):
            text = req["prompt"]
        else:
            return list(req["prompt"])
        ids = await asyncio.to_thread(tok.encode, text) if len(text) > _THREAD_TOKENIZE_CHARS else tok.encode(text)
        return list(ids)

    def _chat_text(self, req: dict[str, Any]) -> str:
        """A chat request's prompt: harmony with today's date, its tools, and any forced call's header."""
        kw = {"reasoning_effort": req["reasoning_effort"]} if req.get("reasoning_effort") else {}
        if req.get("tools"):
            kw["tools"] = req["tools"]
        try:
            text = self.llm.tokenizer.apply_chat_template(req["messages"], add_generation_prompt=req.get(
                "add_generation_prompt", True), current_date=today(), **kw)
        except TypeError:
            raise ValueError("reasoning_effort is not supported by this model's chat template") from None
        return text + req.get("prefill", "")

    def _logprob_entries(self, ids: list[int], logprobs: list[dict], n: int) -> list[dict[str, Any]]:
        """The engine's {token_id: Logprob} per token -> OpenAI's entries: token text, log-probability (a
        token top-k/top-p filtered out has -inf, which JSON lacks: OpenAI's -9999.0), UTF-8 bytes, top n."""
        table = self.llm.tokenizer.token_bytes(False)

        def entry(i: int, lp: float) -> dict[str, Any]:
            b = table[i] if table is not None else self.llm.tokenizer.decode([i], False).encode()
            return {"token": b.decode("utf-8", "replace"), "logprob": max(lp, -9999.0), "bytes": list(b)}

        out = []
        for i, d in zip(ids, logprobs):
            top = sorted(d.items(), key=lambda kv: kv[1].rank)[:n]
            out.append(entry(i, d[i].logprob) | {"top_logprobs": [entry(t, lp.logprob) for t, lp in top]})
        return out

    async def tokenize(self, req: dict[str, Any]) -> dict[str, Any]:
        """`/tokenize`: the ids a prompt (or chat, rendered as `generate` renders it) becomes."""
        tok = self.llm.tokenizer
        try:
            text = self._chat_text(req) if req.get("kind") == "chat" else req["prompt"]
            if len(text) > self.max_model_len * self.max_chars_per_token:
                raise ValueError(f"The text has {len(text)} characters, more than max_model_len "
                                 f"({self.max_model_len} tokens) can hold.")
            ids = await asyncio.to_thread(tok.encode, text)
        except ValueError as e:
            return _error(400, str(e), param="messages" if req.get("kind") == "chat" else "prompt")
        strs = [tok.backend.id_to_token(i) for i in ids] if req.get("return_token_strs") else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            return {"prompt": self.llm.tokenizer.decode(req["tokens"])}
        except ValueError as e:
            return _error(400, str(e), param="tokens")

    def _sampling_params(self, req: dict[str, Any], n_prompt: int):
        """The router's checked values; an explicit max_tokens must fit beside the prompt (OpenAI's 400), where
        offline generation (`LLM`) stops at the context's end."""
        from peagle_core import SamplingParams

        kw = dict(req.get("sampling") or {})
        mt = req.get("max_tokens")
        if mt is not None and n_prompt < self.max_model_len < n_prompt + mt:
            raise _too_long(f"This model's maximum context length is {self.max_model_len} tokens; you requested "
                            f"{n_prompt + mt} tokens ({n_prompt} in the prompt, {mt} for the completion).",
                            "max_tokens")
        return SamplingParams(**kw)

    # ------------------------------------------------------------------------------------------

    def _poll_forever(self) -> None:
        """Engine stats -> Prometheus gauges/counters and the application's stats board.

        A thread, not a task: it starts with the replica (no event loop needed yet) and keeps
        reporting while the event loop is busy streaming."""
        interval = self.settings.metrics_interval_s
        board, app = None, _app_name()
        me = _current_actor() if app is not None else None  # lets the board see at once when this replica dies
        while not self._stop_polling.wait(interval):
            try:
                stats = self.llm.stats()
                self.metrics.poll(stats)
                if app is not None:
                    board = board or lookup_board(app)
                    if board is not None:
                        board.report.remote(self.replica_id, self._summary(stats), me)
            except Exception:
                board = None  # the board may have moved (router restarted): look it up again next time
                log.debug("stats poll failed", exc_info=True)

    def _summary(self, engine_stats: dict[str, Any]) -> dict[str, Any]:
        return {"ongoing": self.ongoing, "served": self.served, "aborted": self.aborted, "errors": self.errors,
                "engine": engine_stats}

    def _limit_cpu_threads(self) -> None:
        """On CPU, keep torch to the cores Ray gave this replica (2 replicas on 2 cores must not fight).
        Only inside a Serve replica: in-process (tests) the thread count belongs to the caller."""
        if (self.settings.engine.device or "cpu").startswith("cuda") or not _in_serve_replica():
            return
        import torch

        cpus = (self.settings.engine_actor_options() or {}).get("num_cpus") or 1
        torch.set_num_threads(max(1, int(cpus)))


def _too_long(message: str, param: str) -> ValueError:
    e = ValueError(message)
    e.param, e.code = param, "context_length_exceeded"
    return e


def _max_chars_per_token(tok) -> int:
    """Upper bound on characters per token, for refusing prompts before tokenising them."""
    try:
        backend = getattr(tok, "backend", tok)
        vocab = backend.get_vocab() if hasattr(backend, "get_vocab") else None
        if vocab:
            return max(8, max(len(t) for t in vocab))
    except Exception:
        pass
    return 64


def _phases(m: dict[str, Any]) -> dict[str, float]:
    """The request's time in the engine by phase, vLLM's: queued, prefill (to the first token), decode, inference."""
    arrival, first, done = m.get("arrival_time"), m.get("first_token_time"), m.get("finished_time")
    scheduled = m.get("first_scheduled_time") or arrival
    if not (arrival and first and done):
        return {}
    return {"queue": max(scheduled - arrival, 0.0), "prefill": max(first - scheduled, 0.0),
            "decode": max(done - first, 0.0), "inference": max(done - scheduled, 0.0)}


def _spec_dict(spec) -> dict[str, Any] | None:
    if spec is None:
        return None
    return {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(spec.num_accepted_tokens_per_pos),
            "acceptance_length": spec.acceptance_length}


def _span_stats(span, out, queue_s: float | None) -> None:
    """vLLM-style `gen_ai.*` latency attributes plus the request's speculation statistics."""
    m = out.metrics or {}
    arrival, first, done = m.get("arrival_time"), m.get("first_token_time"), m.get("finished_time")
    scheduled = m.get("first_scheduled_time") or arrival
    span.set_attribute("gen_ai.usage.prompt_tokens", len(out.prompt_token_ids or []))
    if m.get("num_generated_tokens") is not None:
        span.set_attribute("gen_ai.usage.completion_tokens", int(m["num_generated_tokens"]))
    if arrival and scheduled:
        span.set_attribute("gen_ai.latency.time_in_queue", max(scheduled - arrival, 0.0))  # engine waiting queue
    if arrival and first:
        span.set_attribute("gen_ai.latency.time_to_first_token", max(first - arrival, 0.0))
    if scheduled and first:
        span.set_attribute("gen_ai.latency.time_in_model_prefill", max(first - scheduled, 0.0))
    if first and done:
        span.set_attribute("gen_ai.latency.time_in_model_decode", max(done - first, 0.0))
    if arrival and done:
        span.set_attribute("gen_ai.latency.e2e", max(done - arrival, 0.0))
    if queue_s is not None:
        span.set_attribute("peagle.latency.time_in_serve_queue", max(queue_s, 0.0))  # router hand-off -> replica
    if out.outputs[0].finish_reason:
        span.set_attribute("gen_ai.response.finish_reasons", [out.outputs[0].finish_reason])
    s = out.spec_decode_stats
    if s is not None:
        span.set_attribute("peagle.spec.num_drafts", s.num_drafts)
        span.set_attribute("peagle.spec.num_draft_tokens", s.num_draft_tokens)
        span.set_attribute("peagle.spec.num_accepted_tokens", s.num_accepted_tokens)
        span.set_attribute("peagle.spec.acceptance_length", float(s.acceptance_length))
        span.set_attribute("peagle.spec.num_accepted_tokens_per_pos", list(s.num_accepted_tokens_per_pos))
        for key, value in speculation_span_attributes(s, m.get("num_steps")).items():
            span.set_attribute(key, value)  # mean depth k over the request's steps, acceptance rate


async def _close_quietly(agen) -> None:
    try:
        await agen.aclose()
    except BaseException:  # already closed, or closing raised the engine's own error: nothing to add
        pass


def _app_name() -> str | None:
    try:
        return serve.get_replica_context().app_name
    except Exception:
        return None


def _current_actor():
    try:
        import ray

        return ray.get_runtime_context().current_actor
    except Exception:
        return None


def _in_serve_replica() -> bool:
    try:
        serve.get_replica_context()
        return True
    except Exception:
        return False


def _current_replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return f"local-{uuid.uuid4().hex[:8]}"


EngineReplica = serve.deployment(name="EngineReplica")(EngineServer)
