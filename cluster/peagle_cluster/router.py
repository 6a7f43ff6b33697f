"""The OpenAI-compatible HTTP ingress: parse and check requests, stream engine deltas as SSE.

The FastAPI app is module-level (Serve's `@serve.ingress` needs it at import time); the per-replica
state lives in a `Frontend` object installed with `install_frontend`, so the same routes run in Ray
Serve (`OpenAIRouter`) and in-process under tests (`Frontend` with a local engine).

Order of checks for a completion request, cheapest first: API key (401), body size and arrival
(413, 408), JSON depth and number length, encodable strings and field types and ranges (400, see
`guard`), model name (404), sampling values (400), prompt characters (400),
then the replica tokenises and checks tokens (400) before the engine sees the request. The HTTP
status is only sent once the replica has accepted the request (its first event), so even a
streaming request gets a real 4xx for bad input. Any failure after that is an SSE error event
followed by `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from peagle_core.engine.types import sample_seed
from peagle_core.loading.tokenizer import tool_call_prefill
from peagle_cluster import guard
from peagle_cluster import protocol as P
from peagle_cluster.protocol import APIError
from peagle_cluster.settings import AppSettings, serve_http_host, startup_warnings
from peagle_cluster.stats_board import aggregate, get_or_create_board
from peagle_cluster.metrics_vllm import CONTENT_TYPE, VLLMMetrics, speculative_decoding
from peagle_cluster.tools import ToolCalls
from peagle_cluster.telemetry import RouterMetrics, extract_context, finished_spans, inject_context, setup_tracing, tracer

log = logging.getLogger("peagle.cluster")

api = FastAPI(title="peagle", docs_url=None, redoc_url=None, openapi_url=None)  # no schema pages in production


# --------------------------------------------------------------------------------------------
# Error handlers: every response, including framework errors, is OpenAI's envelope
# --------------------------------------------------------------------------------------------

def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@api.exception_handler(APIError)
async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return error_response(e)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    msg = {404: f"Unknown route {request.method} {request.url.path}",
           405: f"Method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
    return error_response(APIError(e.status_code, msg))


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    return error_response(APIError(400, "Invalid request parameters", code="invalid_value"))


@api.exception_handler(Exception)
async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(APIError(500, "Internal server error", code="internal_error"))


# --------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------

_FRONTEND: "Frontend | None" = None


def install_frontend(frontend: "Frontend") -> None:
    """Serve copies the FastAPI object into each replica, so per-replica state is a module global
    (the route functions are imported, not copied, and read it)."""
    global _FRONTEND
    _FRONTEND = frontend


def _frontend(request: Request) -> "Frontend":
    if _FRONTEND is None:
        raise APIError(503, "The server is starting.", code="starting")
    return _FRONTEND


@api.get("/health")
async def health(request: Request) -> Response:
    return await _frontend(request).health()


@api.get("/v1/models")
async def list_models(request: Request) -> Response:
    f = _frontend(request)
    f.authenticate(request)
    return JSONResponse({"object": "list", "data": [await f.model_card()]})


@api.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str) -> Response:
    f = _frontend(request)
    f.authenticate(request)
    f.check_model(model)
    return JSONResponse(await f.model_card())


@api.get("/v1/stats")
async def cluster_stats(request: Request) -> Response:
    """Not OpenAI: every replica's load, KV usage and speculation counters, plus cluster totals."""
    f = _frontend(request)
    f.authenticate(request)
    return JSONResponse(await f.cluster_stats())


@api.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """vLLM's: the token ids of a prompt or of chat messages (rendered as chat renders them)."""
    return await _frontend(request).unary(request, P.TokenizeRequest, "tokenize", lambda r: r.replica_request())


@api.post("/detokenize")
async def detokenize(request: Request) -> Response:
    return await _frontend(request).unary(request, P.DetokenizeRequest, "detokenize", lambda r: {"tokens": r.tokens})


@api.get("/version")
async def version(request: Request) -> Response:
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        v = dist_version("peagle")
    except PackageNotFoundError:
        v = "unknown"
    return JSONResponse({"version": v})


@api.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text with vLLM's metric names (peagle_cluster.metrics_vllm); no API key, as vLLM's."""
    f = _frontend(request)
    return Response(f.vllm_metrics.render(await f.cluster_stats()), media_type=CONTENT_TYPE)


@api.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _frontend(request).complete(request, chat=True)


@api.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _frontend(request).complete(request, chat=False)


# --------------------------------------------------------------------------------------------
# The logic
# --------------------------------------------------------------------------------------------

class Frontend:
    """Per-router state: settings, the engine handle, metrics. `engine` is a DeploymentHandle to
    `EngineReplica` (or, in tests, anything with the same `.options(stream=True).generate.remote`)."""

    def __init__(self, settings: AppSettings, engine: Any, board: Any = None):
        self.settings = settings
        self.engine = engine
        self.board = board
        self.model = settings.model_name
        self.aliases = {self.model, settings.engine_args.get("model", "tiny")}
        key = settings.resolved_api_key()
        self._key_hash = hashlib.sha256(key.encode()).digest() if key else None
        self.metrics = RouterMetrics(self.model)
        self.vllm_metrics = VLLMMetrics(self.model)
        cfg = settings.engine
        self.num_spec_tokens = cfg.num_spec_tokens if cfg.spec_mode != "none" else 0
        self._info: dict[str, Any] | None = None
        self.created = int(time.time())

    # -- checks ----------------------------------------------------------------------------------
    def authenticate(self, request: Request) -> None:
        if self._key_hash is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        # Compare digests in constant time: no timing side channel on the key.
        if not token or not secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._key_hash):
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.aliases:
            raise APIError(404, f"The model `{guard.echo(model)}` does not exist. This server serves `{self.model}`.",
                           param="model", code="model_not_found")

    async def read_body(self, request: Request) -> bytes:
        return await guard.read_body(request.stream(), self.settings.max_request_body_bytes,
                                     self.settings.body_read_timeout_s, request.headers.get("content-length"))

    async def info(self) -> dict[str, Any]:
        """max_model_len and friends, asked of a replica once (the builder does not load the model)."""
        if self._info is None:
            self._info = await _call(self.engine.info)
        return self._info

    async def model_card(self) -> dict[str, Any]:
        info = await self.info()
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "peagle",
                "root": self.settings.engine_args.get("model"), "max_model_len": info["max_model_len"]}

    async def unary(self, request: Request, model, method: str, payload) -> Response:
        """A request answered by one replica call (`payload(req)` is what the replica gets); the replica's
        error dict becomes the API error."""
        self.authenticate(request)
        req = P.parse_request(model, await self.read_body(request))
        self.check_model(req.model)
        try:
            out = await getattr(self.engine, method).remote(payload(req))
        except Exception as e:
            raise _ray_error(e) from None
        if out.get("event") == "error":
            raise APIError(out["status"], out["message"], out.get("param"), out.get("code"))
        return JSONResponse(out)

    async def cluster_stats(self) -> dict[str, Any]:
        if self.board is not None:
            try:
                return await self.board.snapshot.remote()
            except Exception as e:
                log.warning("stats board unavailable: %s", e)
        return aggregate([await _call(self.engine.stats)])  # one replica's view

    async def health(self) -> Response:
        try:
            body = await asyncio.wait_for(self.engine.health.remote(), timeout=10)
            return JSONResponse({"status": "ok", **body})
        except asyncio.TimeoutError:
            return error_response(APIError(503, "The engine did not answer the health check in time.",
                                           code="unhealthy"))
        except Exception as e:
            log.warning("health check failed: %s", e)
            return error_response(APIError(503, "The engine is not healthy.", code="unhealthy"))

    # -- completions -----------------------------------------------------------------------------
    async def complete(self, request: Request, chat: bool) -> Response:
        """One path for every completion: the request is checked here, once; each choice (a prompt's sample:
        `n` of each prompt, choice index = prompt * n + sample) is one engine request, streamed or collected."""
        route = "/v1/chat/completions" if chat else "/v1/completions"
        t0 = time.perf_counter()
        span = tracer().start_span("router.completion", context=_parent_context(request))
        span.set_attribute("http.route", route)
        handed_off = False
        try:
            self.authenticate(request)
            body = await self.read_body(request)
            req = P.parse_request(P.ChatCompletionRequest if chat else P.CompletionRequest, body)
            self.check_model(req.model)
            sampling = req.sampling_kwargs(default_max_tokens=None if chat else 16)
            _check_sampling(sampling)
            info = await self.info()
            limit_chars = info["max_model_len"] * info["max_chars_per_token"]
            if req.char_length() > limit_chars:
                raise APIError(400, f"The prompt has {req.char_length()} characters, more than this model's context "
                                    f"of {info['max_model_len']} tokens can hold.",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
            prompts = [None] if chat else req.prompts()
            n = sampling.pop("n", 1)
            if len(prompts) * n > P.MAX_CHOICES:
                raise APIError(400, f"{len(prompts)} prompts x n={n} is more than {P.MAX_CHOICES} choices in one "
                                    "request", param="n", code="invalid_value")
            rid = P.new_id("chatcmpl" if chat else "cmpl")
            span.set_attribute("gen_ai.request.id", rid)
            span.set_attribute("gen_ai.request.model", self.model)
            span.set_attribute("peagle.stream", bool(req.stream))
            if req.user:
                span.set_attribute("enduser.id", req.user)
            trace_ctx = inject_context(span)
            several = len(prompts) * n > 1
            streams = [self.engine.options(stream=True).generate.remote(engine_request(
                f"{rid}-{k}" if several else rid, req, sampling | {"seed": sample_seed(sampling.get("seed"), k % n)},
                chat, trace_ctx, prompt=p)) for k, p in enumerate(p for p in prompts for _ in range(n))]
            label = (lambda k: f"prompt {k // n}: ") if len(prompts) > 1 else (lambda k: "")
            firsts = await _first_events(streams, label)
            if req.stream:
                handed_off = True
                return StreamingResponse(self._sse(rid, req, chat, firsts, streams, label, span, route, t0),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return await self._collect(rid, req, chat, firsts, streams, label, route, t0)
        except APIError as e:
            span.set_attribute("http.status_code", e.status)
            self.metrics.observe(route, e.status)
            if e.code == "overloaded":
                self.metrics.rejected.inc(1, tags={"model": self.model})
            return error_response(e)
        finally:
            if not handed_off:
                span.end()

    async def _collect(self, rid: str, req, chat: bool, firsts: list[dict], streams: list, label, route: str,
                       t0: float) -> Response:
        choices = [_Choice() for _ in streams]

        async def drain(c: _Choice, ev: dict[str, Any], stream) -> dict[str, Any]:
            while ev["event"] == "delta":
                c.add(ev, self._token_times)
                ev = await _next_event(stream)
            if ev["event"] == "final":
                await _finish(stream)
            return ev

        try:
            lasts = await asyncio.gather(*(drain(c, f, s) for c, f, s in zip(choices, firsts, streams)))
        except BaseException:
            for s in streams:
                s.cancel()  # the caller went away (or we failed): stop generating for nobody
            raise
        for k, ev in enumerate(lasts):
            if ev["event"] == "error":
                raise APIError(ev["status"], label(k) + ev["message"], ev.get("param"), ev.get("code"))
        totals, specs, out = [0, 0, 0], [], []
        logprobs = req.num_logprobs() is not None
        for k, (c, ev) in enumerate(zip(choices, lasts)):
            use, _ = self._finished(ev, t0, c.t_first)
            totals = [a + use[key] for a, key in zip(totals, ("prompt_tokens", "completion_tokens"))] + \
                [totals[2] + use["prompt_tokens_details"]["cached_tokens"]]
            specs.append(ev.get("spec"))
            text = "".join(c.text)
            if chat:
                reasoning = ("".join(c.reasoning) or None) if req.include_reasoning is not False else None
                out.append(P.chat_choice(k, text, c.calls.finish_reason(ev["finish_reason"]), reasoning, c.calls.calls,
                                         P.chat_logprobs(c.lps) if logprobs else None))
            else:
                out.append(P.completion_choice(k, text, ev["finish_reason"],
                                               P.completion_logprobs(c.lps) if logprobs else None))
        body = (P.chat_response if chat else P.completion_response)(rid, self.model, P.now(), out, P.usage(*totals))
        spec = speculative_decoding(_sum_specs(specs), self.num_spec_tokens)
        self.metrics.observe(route, 200, time.perf_counter() - t0)
        return JSONResponse(body | ({"metrics": {"speculative_decoding": spec}} if spec is not None else {}))

    def _token_times(self, ev: dict[str, Any], t_first: float | None, t_last: float | None):
        """(first, last) arrival of a delta with tokens; the gaps between them are vLLM's inter-token latency."""
        if not ev.get("num_tokens"):
            return t_first, t_last
        now = time.perf_counter()
        if t_last is not None:
            self.vllm_metrics.observe_step_gap(now - t_last)
        return (t_first or now), now

    def _finished(self, ev: dict[str, Any], t0: float, t_first: float | None) -> tuple[dict, dict]:
        """A request's final event -> its `usage`, the response's extra keys (vLLM's `metrics`), and /metrics."""
        u = ev["usage"]
        use = P.usage(u["prompt_tokens"], u["completion_tokens"], u.get("cached_tokens", 0))
        self.vllm_metrics.observe(None if t_first is None else t_first - t0, time.perf_counter() - t0,
                                  u["prompt_tokens"], u["completion_tokens"], ev["finish_reason"], ev.get("spec"),
                                  ev.get("phases"), u.get("cached_tokens", 0))
        spec = speculative_decoding(ev.get("spec"), self.num_spec_tokens)
        return use, ({"metrics": {"speculative_decoding": spec}} if spec is not None else {})

    async def _sse(self, rid: str, req, chat: bool, firsts: list[dict], streams: list, label, span, route: str,
                   t0: float) -> AsyncIterator[bytes]:
        """Every choice's chunks as they come, each with its `index`; a choice's finish chunk carries its vLLM
        metrics, the usage chunk sums the choices. An error after the 200 is an error event, then [DONE]."""
        created, include_usage, obj = P.now(), req.include_usage, ("chat.completion.chunk" if chat else "text_completion")
        show_reasoning = not chat or req.include_reasoning is not False
        choices = [_Choice() for _ in streams]
        events = _merged(firsts, streams)
        done, totals, completed = 0, [0, 0, 0], False
        try:
            if chat:
                for k in range(len(streams)):
                    yield P.sse(P.chat_chunk(rid, self.model, created, {"role": "assistant", "content": ""}, None,
                                             include_usage, index=k))
            while done < len(streams):
                k, ev = await events.__anext__()
                c = choices[k]
                if ev["event"] == "delta":
                    c.t_first, c.t_last = self._token_times(ev, c.t_first, c.t_last)
                    if chat:
                        delta = {}
                        if ev.get("reasoning") and show_reasoning:
                            delta["reasoning"] = delta["reasoning_content"] = ev["reasoning"]
                        if ev["text"]:
                            delta["content"] = ev["text"]
                        if ev.get("tool_calls"):
                            delta["tool_calls"] = c.calls.delta(ev["tool_calls"])
                        lp = P.chat_logprobs(ev["logprobs"]) if ev.get("logprobs") else None
                        if delta or lp:
                            yield P.sse(P.chat_chunk(rid, self.model, created, delta, None, include_usage, lp, index=k))
                    elif ev["text"] or ev.get("logprobs"):
                        lp = P.completion_logprobs(ev["logprobs"], c.offset) if ev.get("logprobs") else None
                        c.offset += len(ev["text"])
                        yield P.sse(P.completion_chunk(rid, self.model, created, ev["text"], None, include_usage, lp,
                                                       index=k))
                elif ev["event"] == "final":
                    done += 1
                    use, extra = self._finished(ev, t0, c.t_first)
                    totals = [totals[0] + use["prompt_tokens"], totals[1] + use["completion_tokens"],
                              totals[2] + use["prompt_tokens_details"]["cached_tokens"]]
                    if chat:
                        last = P.chat_chunk(rid, self.model, created, {}, c.calls.finish_reason(ev["finish_reason"]),
                                            include_usage, index=k)
                    else:
                        last = P.completion_chunk(rid, self.model, created, "", ev["finish_reason"], include_usage,
                                                  index=k)
                    yield P.sse(last | extra)  # vLLM's per-request metrics ride on the finish chunk
                    await _finish(streams[k])
                else:
                    span.set_attribute("error.type", str(ev.get("code") or ev["status"]))
                    yield P.sse(P.error_body(ev["status"], label(k) + ev["message"], ev.get("param"), ev.get("code")))
                    break
            else:
                if include_usage:
                    yield P.sse(P.usage_chunk(rid, self.model, created, obj, P.usage(*totals)))
            completed = True
            yield P.SSE_DONE
            self.metrics.observe(route, 200, time.perf_counter() - t0)
        finally:
            await events.aclose()
            if not completed:
                # The client disconnected (Starlette closed this generator): cancel the replica calls, whose
                # generators close the engine streams, which abort the requests and free their KV blocks.
                for s in streams:
                    s.cancel()
                span.set_attribute("peagle.client_disconnected", True)
                self.metrics.observe(route, 499)
            span.end()


async def _merged(firsts: list[dict], streams: list) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """Every choice's events as they come, as (index, event), each stream ending at its first non-delta event (a
    failed read becomes an error event). One stream is read in line; several through a queue of one, so no
    stream is read ahead of the client (a slow client holds its engine slot instead of piling output up here)."""
    async def events(ev: dict[str, Any], stream) -> AsyncIterator[dict[str, Any]]:
        while True:
            yield ev
            if ev["event"] != "delta":
                return
            try:
                ev = await _next_event(stream)
            except APIError as e:
                ev = {"event": "error", "status": e.status, "message": e.message, "param": e.param, "code": e.code}

    if len(streams) == 1:
        async for ev in events(firsts[0], streams[0]):
            yield 0, ev
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)

    async def pump(k: int, first: dict[str, Any], stream) -> None:
        async for ev in events(first, stream):
            await queue.put((k, ev))

    tasks = [asyncio.ensure_future(pump(k, f, s)) for k, (f, s) in enumerate(zip(firsts, streams))]
    try:
        while True:
            yield await queue.get()
    finally:
        for t in tasks:
            t.cancel()


class _Choice:
    """One choice's stream, gathered: text (a chat reply's content), reasoning, tool calls, logprob entries."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls = ToolCalls()
        self.lps: list[dict[str, Any]] = []
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.offset = 0  # completions' streamed logprobs: where the next text starts

    def add(self, ev: dict[str, Any], token_times) -> None:
        self.lps += ev.get("logprobs") or []
        self.t_first, self.t_last = token_times(ev, self.t_first, self.t_last)
        self.text.append(ev["text"])
        if ev.get("reasoning"):
            self.reasoning.append(ev["reasoning"])
        if ev.get("tool_calls"):
            self.calls.delta(ev["tool_calls"])


def _sum_specs(specs: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Speculation counters of several requests added up (per-position counts position by position)."""
    specs = [s for s in specs if s is not None]
    if not specs:
        return None
    width = max(len(s["num_accepted_tokens_per_pos"]) for s in specs)
    out = {k: sum(s[k] for s in specs) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    out["num_accepted_tokens_per_pos"] = [sum(s["num_accepted_tokens_per_pos"][j]
                                              for s in specs if j < len(s["num_accepted_tokens_per_pos"]))
                                          for j in range(width)]
    return out


def _parent_context(request: Request):
    """The HTTP server span when the ASGI layer made one; else the caller's `traceparent` header."""
    from opentelemetry import trace

    if trace.get_current_span().get_span_context().is_valid:
        return None  # start_span then uses the current context
    return extract_context(dict(request.headers))


def engine_request(rid: str, req, sampling: dict[str, Any], chat: bool, trace_ctx: dict[str, str],
                   prompt: str | list[int] | None = None) -> dict[str, Any]:
    """The plain-dict request a replica's `generate` receives."""
    d: dict[str, Any] = {"request_id": rid, "kind": "chat" if chat else "completion", "sampling": sampling,
                         "max_tokens": req.requested_max_tokens(), "trace": trace_ctx, "sent_at": time.time()}
    if chat:
        d["messages"] = req.template_messages()
        if req.reasoning_effort:
            d["reasoning_effort"] = req.reasoning_effort
        d["tools"] = req.harmony_tools()
        forced, name = req.forced_call()
        if forced:  # the reply starts inside a call's header (harmony's way of requiring a call)
            d["prefill"] = tool_call_prefill(name)
    else:
        d["prompt"] = req.single_prompt() if prompt is None else prompt
    return d


def _check_sampling(kw: dict[str, Any]) -> None:
    from peagle_core import SamplingParams

    try:
        SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        param = next((k for k in kw if k in str(e)), None)
        raise APIError(400, str(e), param=param, code="invalid_value") from None


# --------------------------------------------------------------------------------------------
# Handle calls: Ray's exceptions -> API errors
# --------------------------------------------------------------------------------------------

async def _call(method) -> Any:
    try:
        return await method.remote()
    except Exception as e:
        raise _ray_error(e) from None


async def _first_events(streams: list, label) -> list[dict[str, Any]]:
    """Every choice's first event: a choice the replica refuses (its first event an error) fails the request,
    with a 4xx naming the prompt (`label`), and the other choices are cancelled."""
    firsts = []
    for k, s in enumerate(streams):  # in turn: the calls are all under way
        try:
            f = await _first_event(s)
        except BaseException:
            # this call failed (a refusal, backpressure): cancelling it as well left Serve's 503 undelivered
            for other in streams[:k] + streams[k + 1:]:
                other.cancel()
            raise
        if f["event"] == "error":
            for other in streams:
                other.cancel()
            raise APIError(f["status"], label(k) + f["message"], f.get("param"), f.get("code"))
        firsts.append(f)
    return firsts


async def _first_event(stream) -> dict[str, Any]:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise APIError(500, "The engine ended the request without a response.", code="internal_error") from None
    except asyncio.CancelledError:
        stream.cancel()
        raise
    except Exception as e:
        raise _ray_error(e) from None


async def _next_event(stream) -> dict[str, Any]:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise APIError(500, "The engine stream ended unexpectedly.", code="internal_error") from None
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise _ray_error(e) from None


async def _finish(stream) -> None:
    """Run the replica's generator to its end after the final event (its spans and counters close
    there); a stream that does not end promptly is cancelled."""
    try:
        await asyncio.wait_for(stream.__anext__(), timeout=5)
    except StopAsyncIteration:
        return
    except asyncio.CancelledError:
        raise
    except Exception:
        pass
    stream.cancel()


def _ray_error(e: BaseException) -> APIError:
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError

    if isinstance(e, APIError):
        return e
    if isinstance(e, BackPressureError):
        return APIError(503, "The server is overloaded: every engine replica is busy and the queue is full. "
                             "Retry after a short wait.", code="overloaded", headers={"Retry-After": "1"})
    if isinstance(e, (RayActorError, DeploymentUnavailableError)) or type(e).__name__ == "ReplicaUnavailableError":
        return APIError(503, "The engine replica serving this request became unavailable; retry the request.",
                        code="replica_unavailable", headers={"Retry-After": "1"})
    if isinstance(e, RequestCancelledError):
        return APIError(503, "The request was cancelled by the server.", code="cancelled")
    log.error("engine call failed: %r", e)
    return APIError(500, "Internal error while talking to the engine.", code="internal_error")


# --------------------------------------------------------------------------------------------
# The Serve deployment
# --------------------------------------------------------------------------------------------

@serve.deployment(name="OpenAIRouter")
@serve.ingress(api)
class OpenAIRouter:
    def __init__(self, settings: dict[str, Any], engine) -> None:
        s = AppSettings.model_validate(settings)
        for warning in startup_warnings(s, serve_http_host()):
            log.warning(warning)
        setup_tracing(s.tracing.exporter, s.tracing.service_name + "-router")
        board = get_or_create_board(serve.get_replica_context().app_name)
        install_frontend(Frontend(s, engine, board))

    async def debug_spans(self) -> list[dict[str, Any]]:
        """Spans of the in-memory exporter (tracing.exporter: memory); empty otherwise."""
        return finished_spans()
