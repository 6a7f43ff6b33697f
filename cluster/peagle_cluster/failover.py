"""Router failure as clients see it: an ASGI middleware for Ray Serve's HTTP proxy.

When the router replica (the ingress) dies, the requests it was serving end inside Serve's proxy,
which answers a plain-text 500 to a non-streaming request and cuts a stream with neither an error
event nor `data: [DONE]`. This middleware runs in the proxy, outside the router, so it still runs
then: an unanswered request gets OpenAI's error envelope as a 503 with `Retry-After`, a cut SSE
stream gets an error event and `data: [DONE]`, and the proxy's own plain-text errors (no replica
yet, queue full, timeout) become envelopes too.

Serve's proxy reads its middlewares from an import path in its own environment
(`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`). The proxy is created by the Serve controller and inherits
the controller's `runtime_env`, which a Serve config sets with its top-level `controller_options` (every
config in configs/ does; `peagle serve` passes CONTROLLER_OPTIONS), so `serve run configs/tiny.yaml`
needs nothing in the shell. Serve applies controller options only when it creates its controller.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

log = logging.getLogger("peagle.cluster")

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "peagle_cluster.failover:proxy_middlewares"
RETRY_AFTER_S = 1
# `controller_options` of a Serve config / `serve.start`: the proxy inherits the controller's env_vars
CONTROLLER_OPTIONS = {"runtime_env": {"env_vars": {CALLBACK_ENV: CALLBACK}}}


def proxy_middlewares() -> list:
    """What Serve's proxy calls (through CALLBACK_ENV) for its middlewares."""
    from starlette.middleware import Middleware

    return [Middleware(RouterFailureMiddleware)]


def enabled() -> bool:
    return os.environ.get(CALLBACK_ENV) == CALLBACK


def envelope(status: int, message: str, code: str) -> bytes:
    from peagle_cluster.protocol import error_body

    return json.dumps(error_body(status, message, code=code)).encode()


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((v for k, v in headers if k.lower() == name), None)


class RouterFailureMiddleware:
    """Every HTTP response leaves the proxy complete: started, with a last body message, and in the
    client's protocol (JSON envelope or SSE)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "ended": False, "sse": False, "held": None, "body": b""}

        async def tracked(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                ctype = (_header(headers, b"content-type") or b"").lower()
                if message["status"] >= 400 and not ctype.startswith(b"application/json"):
                    state["held"] = message  # the proxy's own plain-text error: rewritten once its body is in
                    return
                state["started"], state["sse"] = True, ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and state["held"] is not None:
                state["body"] += message.get("body", b"")
                if not message.get("more_body"):
                    await self._rewrite(send, state)
                return
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:  # the proxy itself failed: the client still gets an answer below
            log.exception("proxy failed on %s", scope.get("path"))
        if state["ended"]:
            return
        try:
            await self._finish(send, state)
        except Exception:  # the client is gone: nothing left to tell it
            pass

    async def _rewrite(self, send, state: dict) -> None:
        from peagle_cluster.guard import echo

        held = state["held"]
        status = held["status"]
        text = state["body"].decode("utf-8", "replace").strip() or "The server could not handle the request."
        extra = [(k, v) for k, v in held.get("headers") or [] if k.lower() in (b"retry-after",)]
        code = {503: "service_unavailable", 408: "timeout", 429: "rate_limited", 404: "not_found"}.get(status, "server_error")
        await _send_json(send, status, envelope(status, echo(text, 300), code), extra)
        state["started"] = state["ended"] = True

    async def _finish(self, send, state: dict) -> None:
        """The app ended without completing its response: the router died under this request."""
        message = "The router serving this request failed; retry the request."
        if not state["started"]:
            await _send_json(send, 503, envelope(503, message, "router_unavailable"),
                             [(b"retry-after", str(RETRY_AFTER_S).encode())])
        elif state["sse"]:
            event = envelope(503, message, "router_unavailable")
            await send({"type": "http.response.body", "body": b"data: " + event + b"\n\ndata: [DONE]\n\n",
                        "more_body": False})
        else:  # a JSON body already half sent cannot be repaired: end it so the client does not wait
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        state["ended"] = True


async def _send_json(send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 503 and not any(k.lower() == b"retry-after" for k, _ in extra):
        extra = extra + [(b"retry-after", str(RETRY_AFTER_S).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + extra})
    await send({"type": "http.response.body", "body": body, "more_body": False})
