"""A tiny OpenAI-compatible SSE server with scripted timing and faults.

It stands in for the cluster when testing the load-test client (the timings are known, so the
measured TTFT/TPOT/ITL have an oracle) and for dry runs of a sweep without a model:

    python -m peagle_loadtest.fake_server --port 8001 --ttft-ms 50 --chunk-ms 20 --tokens-per-chunk 3

Each content chunk carries `tokens_per_chunk` tokens ("tok " each), as a speculative decoder
bundles accepted tokens; `/metrics` exports spec-decode counters whose acceptance length is exactly
`tokens_per_chunk`. `--serve-config` reads a `serve run` YAML (port, speculative_config) so the
sweep's per-mode launcher can be exercised without Ray.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

FAULTS = ("ok", "http500", "error_event", "empty", "no_done", "no_usage")


@dataclass
class FakeBehavior:
    ttft_ms: float = 30.0
    chunk_ms: float = 10.0
    tokens_per_chunk: int = 1
    output_tokens: int | None = None  # None: max_tokens of the request
    slowdown_per_active: float = 0.0  # chunk time grows by this fraction per extra concurrent request
    faults: list[str] = field(default_factory=lambda: ["ok"])  # cycled, one per request
    model: str = "fake-model"
    spec_in_usage: bool = False  # per-request counters in the usage chunk, as vLLM's metrics.speculative_decoding

    def __post_init__(self) -> None:
        bad = [f for f in self.faults if f not in FAULTS]
        if bad or not self.faults:
            raise ValueError(f"unknown fault(s) {bad}; choose from {FAULTS}")
        if self.tokens_per_chunk < 1:
            raise ValueError("tokens_per_chunk must be >= 1")


class FakeOpenAI:
    def __init__(self, behavior: FakeBehavior):
        self.b = behavior
        self._faults = itertools.cycle(behavior.faults)
        self.active = 0
        self.counters = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "requests": 0}
        self.bodies: list[dict[str, Any]] = []  # every request body, for tests to inspect

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", lambda r: web.Response(text=""))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/stats", self.stats)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/v1/completions", self.generate)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.b.model, "object": "model"}]})

    async def stats(self, request: web.Request) -> web.Response:
        # the cluster's GET /v1/stats shape: totals under "spec", then per replica
        spec = {k: self.counters[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        return web.json_response({"spec": spec, "num_replicas": 1, "replicas": [{"engine": {"spec": spec}}]})

    async def metrics(self, request: web.Request) -> web.Response:
        # Prometheus text, shaped like Ray's export of our counters (ray_ prefix, _total suffix).
        lines = []
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            name = f"ray_peagle_spec_decode_{k}_total"
            lines += [f"# TYPE {name} counter", f'{name}{{deployment="fake"}} {self.counters[k]}']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.counters["requests"] += 1
        fault = next(self._faults)
        if fault == "http500":
            return web.json_response({"error": {"message": "scripted failure", "type": "internal_error",
                                                "code": 500}}, status=500)
        chat = request.path.endswith("/chat/completions")
        n_tokens = self.b.output_tokens or int(body.get("max_tokens") or 16)
        k = self.b.tokens_per_chunk
        sizes = [k] * (n_tokens // k) + ([n_tokens % k] if n_tokens % k else [])
        if not body.get("stream"):
            await asyncio.sleep((self.b.ttft_ms + self.b.chunk_ms * (len(sizes) - 1)) / 1000)
            text = "tok " * n_tokens
            choice = {"index": 0, "finish_reason": "length",
                      **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
            return web.json_response({"id": "fake", "object": "chat.completion" if chat else "text_completion",
                                      "model": self.b.model, "choices": [choice],
                                      "usage": {"prompt_tokens": 7, "completion_tokens": n_tokens,
                                                "total_tokens": 7 + n_tokens}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        self.active += 1
        try:
            await self._stream(resp, chat, sizes, fault, body)
        finally:
            self.active -= 1
        return resp

    async def _stream(self, resp: web.StreamResponse, chat: bool, sizes: list[int], fault: str,
                      body: dict[str, Any]) -> None:
        async def send(obj: Any) -> None:
            await resp.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

        def chunk(text: str | None, finish: str | None = None) -> dict[str, Any]:
            if chat:
                delta = {} if text is None else {"content": text}
                c = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "finish_reason": finish}
            return {"id": "fake", "object": "chat.completion.chunk" if chat else "text_completion",
                    "model": self.b.model, "choices": [c]}

        if chat:  # vLLM-style empty role chunk first: TTFT must skip it
            await send({"id": "fake", "object": "chat.completion.chunk", "model": self.b.model,
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        await asyncio.sleep(self.b.ttft_ms / 1000)
        if fault == "error_event":
            await send({"error": {"message": "scripted mid-stream failure", "type": "internal_error"}})
            await send(b"[DONE]")
            return
        drafts = accepted = 0
        for i, n in enumerate(sizes):
            if i:
                slow = 1.0 + self.b.slowdown_per_active * max(self.active - 1, 0)
                await asyncio.sleep(self.b.chunk_ms * slow / 1000)
            await send(chunk("" if fault == "empty" else "tok " * n))
            if i:  # every chunk after the first is one verify step: 1 bonus + (n - 1) accepted drafts
                self.counters["num_drafts"] += 1
                self.counters["num_draft_tokens"] += max(self.b.tokens_per_chunk - 1, 1)
                self.counters["num_accepted_tokens"] += n - 1
                drafts, accepted = drafts + 1, accepted + n - 1
        await send(chunk(None, "length"))
        if fault != "no_usage" and (body.get("stream_options") or {}).get("include_usage"):
            n = sum(sizes)
            final = {"id": "fake", "object": "chat.completion.chunk" if chat else "text_completion",
                     "model": self.b.model, "choices": [],
                     "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}}
            if self.b.spec_in_usage:
                final["metrics"] = {"speculative_decoding": {
                    "num_spec_steps": drafts, "num_accepted_draft_tokens": accepted,
                    "num_draft_tokens": drafts * max(self.b.tokens_per_chunk - 1, 1)}}
            await send(final)
        if fault != "no_done":
            await send(b"[DONE]")


class FakeServerThread:
    """Runs the fake on 127.0.0.1 on a free port in a background thread (for tests)."""

    def __init__(self, behavior: FakeBehavior | None = None):
        self.fake = FakeOpenAI(behavior or FakeBehavior())
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self.fake.app(), access_log=None, shutdown_timeout=1.0)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> "FakeServerThread":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server did not start within 10 s")
        return self

    def __exit__(self, *exc: Any) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def behavior_from_serve_config(path: str) -> tuple[FakeBehavior, int]:
    """Speed of a fake 'cluster' from a serve config: speculation bundles 1 + K//2 tokens per chunk."""
    import yaml

    with open(path) as f:
        cfg = yaml.safe_load(f)
    port = int((cfg.get("http_options") or {}).get("port", 8000))
    spec = ((cfg.get("applications") or [{}])[0].get("args") or {}).get("speculative_config")
    k = int(spec.get("num_speculative_tokens", 2)) if spec else 0
    per_chunk = 1 + k // 2 + (1 if spec and spec.get("parallel_drafting") else 0) if spec else 1
    return FakeBehavior(ttft_ms=20.0, chunk_ms=8.0, tokens_per_chunk=per_chunk, slowdown_per_active=0.05), port


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--ttft-ms", type=float, default=30.0)
    p.add_argument("--chunk-ms", type=float, default=10.0)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    p.add_argument("--output-tokens", type=int, default=None)
    p.add_argument("--slowdown-per-active", type=float, default=0.0)
    p.add_argument("--faults", default="ok", help=f"comma list cycled per request, from {','.join(FAULTS)}")
    p.add_argument("--spec-in-usage", action="store_true", help="per-request spec counters in the usage chunk")
    p.add_argument("--serve-config", default=None, help="take port and speed from a `serve run` YAML")
    a = p.parse_args(argv)
    if a.serve_config:
        behavior, port = behavior_from_serve_config(a.serve_config)
    else:
        behavior, port = FakeBehavior(a.ttft_ms, a.chunk_ms, a.tokens_per_chunk, a.output_tokens,
                                      a.slowdown_per_active, a.faults.split(","),
                                      spec_in_usage=a.spec_in_usage), a.port
    print(f"fake OpenAI server on http://{a.host}:{port} ({behavior})", flush=True)
    web.run_app(FakeOpenAI(behavior).app(), host=a.host, port=port, print=None, access_log=None)


if __name__ == "__main__":
    main()
