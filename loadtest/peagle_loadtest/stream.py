"""One streamed OpenAI request, timed the way `vllm bench serve` times it.

This module never imports locust (importing locust monkey-patches the whole process with gevent),
so the sweep, the tests and the Locust user all share it.

Definitions (all in milliseconds, per request):
- ttft: from sending the request to the first SSE chunk that carries non-empty text. Servers often
  send an empty `role` chunk first; counting it would flatter TTFT.
- e2el: from sending the request to the end of the stream.
- tpot: (e2el - ttft) / (output_tokens - 1), with output_tokens from the server's `usage`
  (`stream_options.include_usage`). With speculative decoding one chunk carries several accepted
  tokens, so chunk gaps are not per-token times; the token count must come from the server.
- itl: gaps between successive content-carrying chunks (pooled over requests when summarised).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Protocol

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass
class RequestRecord:
    """What one request produced; written one JSON line per request by the Locust user."""

    ok: bool
    error: str | None
    start_time: float  # epoch seconds when the request was sent
    e2el_ms: float
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: prompt tokens from the prefix cache
    usage_reported: bool = False  # False: output_tokens is a chunk count, a lower bound under speculation
    finish_reason: str | None = None
    text_chars: int = 0
    status_code: int | None = None
    # Per-request speculation counters when the server puts them in the final chunk (None otherwise)
    spec_num_drafts: int | None = None
    spec_num_draft_tokens: int | None = None
    spec_num_accepted_tokens: int | None = None

    @property
    def tpot_ms(self) -> float | None:
        """vLLM's TPOT, excluding the first token; undefined for one-token answers."""
        if self.ttft_ms is None or self.output_tokens < 2:
            return None
        return (self.e2el_ms - self.ttft_ms) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_ms"] = self.tpot_ms
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RequestRecord":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


def build_request(endpoint: str, model: str, prompt: str | list[dict[str, str]], *, max_tokens: int,
                  temperature: float, ignore_eos: bool = False, stream: bool = True) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) for a chat or completions request with usage in the final chunk."""
    if endpoint not in ("chat", "completions"):
        raise ValueError(f"endpoint must be 'chat' or 'completions', got {endpoint!r}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension: fixed output length for synthetic runs
    if endpoint == "chat":
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return CHAT_PATH, {**body, "messages": messages}
    text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)
    return COMPLETIONS_PATH, {**body, "prompt": text}


def spec_counts(obj: Any) -> dict[str, int] | None:
    """Per-request speculation counters anywhere in a chunk outside `choices`: ours
    (num_drafts, num_draft_tokens, num_accepted_tokens) or vLLM's per-request names
    (num_spec_steps, num_draft_tokens, num_accepted_draft_tokens)."""
    if isinstance(obj, dict):
        drafts = obj.get("num_drafts", obj.get("num_spec_steps"))
        accepted = obj.get("num_accepted_tokens", obj.get("num_accepted_draft_tokens"))
        if isinstance(drafts, (int, float)) and isinstance(accepted, (int, float)):
            return {"num_drafts": int(drafts), "num_accepted_tokens": int(accepted),
                    "num_draft_tokens": int(obj.get("num_draft_tokens") or 0)}
        for k, v in obj.items():
            if k != "choices" and (found := spec_counts(v)):
                return found
    return None


def _choice_text(choice: dict[str, Any]) -> str:
    """Visible text of one streamed choice: chat delta content/reasoning, or completions text."""
    delta = choice.get("delta") or {}
    # `reasoning_content` is `reasoning`'s older name: a server may send both, with the same text
    parts = [delta.get("content"), delta.get("reasoning", delta.get("reasoning_content")), choice.get("text")]
    return "".join(p for p in parts if isinstance(p, str))


class StreamAccumulator:
    """Feeds raw SSE bytes with their arrival times; yields a RequestRecord at the end.

    Network chunks and SSE events do not line up (an event can be split, or several can arrive
    together), so bytes are buffered and split on the blank line that ends an event. An event is
    timed by the arrival of the bytes that completed it.
    """

    def __init__(self, t_start: float, start_time: float):
        self.t_start = t_start  # perf_counter() at send
        self.start_time = start_time
        self._buf = b""
        self.ttft_ms: float | None = None
        self._last_content_ms: float | None = None
        self.itl_ms: list[float] = []
        self.chunks_with_text = 0
        self.text: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.spec: dict[str, int] | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.error: str | None = None

    def feed(self, data: bytes, t: float) -> None:
        self._buf += data.replace(b"\r\n", b"\n")
        while b"\n\n" in self._buf:
            event, self._buf = self._buf.split(b"\n\n", 1)
            self._event(event, t)

    def _event(self, event: bytes, t: float) -> None:
        lines = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
        if not lines:
            return  # comment or keep-alive
        payload = b"\n".join(lines)
        if payload == b"[DONE]":
            self.done = True
            return
        if self.done or self.error:
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            self.error = f"malformed SSE data: {payload[:80]!r}"
            return
        if not isinstance(obj, dict):
            self.error = f"SSE data is not a JSON object: {payload[:80]!r}"
            return
        if obj.get("error"):
            err = obj["error"]
            self.error = "server error: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
            self.spec = spec_counts(obj) or self.spec
        for choice in obj.get("choices") or []:
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            text = _choice_text(choice)
            if not text:
                continue
            now_ms = (t - self.t_start) * 1000.0
            if self.ttft_ms is None:
                self.ttft_ms = now_ms
            else:
                self.itl_ms.append(now_ms - self._last_content_ms)
            self._last_content_ms = now_ms
            self.chunks_with_text += 1
            self.text.append(text)

    def finish(self, t_end: float, status_code: int | None = 200) -> RequestRecord:
        e2el_ms = (t_end - self.t_start) * 1000.0
        usage = self.usage or {}
        completion = usage.get("completion_tokens")
        tokens = int(completion) if isinstance(completion, (int, float)) else self.chunks_with_text
        error = self.error
        if error is None and not self.done:
            error = "stream ended without 'data: [DONE]'"
        if error is None and self.chunks_with_text == 0:
            error = "empty answer (no content in any chunk)"
        return RequestRecord(
            ok=error is None, error=error, start_time=self.start_time, e2el_ms=e2el_ms, ttft_ms=self.ttft_ms,
            itl_ms=self.itl_ms, output_tokens=tokens, prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            usage_reported=completion is not None, finish_reason=self.finish_reason,
            text_chars=sum(len(s) for s in self.text), status_code=status_code,
            spec_num_drafts=(self.spec or {}).get("num_drafts"),
            spec_num_draft_tokens=(self.spec or {}).get("num_draft_tokens"),
            spec_num_accepted_tokens=(self.spec or {}).get("num_accepted_tokens"))


class StreamingResponse(Protocol):
    status_code: int
    text: str

    def iter_content(self, chunk_size: int | None = ..., decode_unicode: bool = ...) -> Iterable[bytes]: ...


def http_error_message(resp: StreamingResponse) -> str:
    """'HTTP 400: <OpenAI error message>' from an error response, whatever its body looks like."""
    try:
        body = resp.text
    except Exception as e:  # a connection dropped while reading the error body
        body = f"<unreadable body: {e}>"
    msg = body.strip()[:200]
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and err.get("message"):
            msg = err["message"]
        elif isinstance(err, str):
            msg = err
    except (ValueError, AttributeError):
        pass
    return f"HTTP {resp.status_code}: {msg}"


def consume_stream(resp: StreamingResponse, t_start: float, start_time: float) -> RequestRecord:
    """Read a streamed (requests-style) response to the end and time it.

    chunk_size=None makes requests/urllib3 hand over each HTTP chunk as soon as it arrives; a
    fixed size would wait for that many bytes and delay every timestamp.
    """
    if resp.status_code != 200:
        t_end = time.perf_counter()
        return RequestRecord(ok=False, error=http_error_message(resp), start_time=start_time,
                             e2el_ms=(t_end - t_start) * 1000.0, status_code=resp.status_code)
    acc = StreamAccumulator(t_start, start_time)
    try:
        for data in resp.iter_content(chunk_size=None):
            if data:
                acc.feed(data, time.perf_counter())
    except Exception as e:  # connection reset / read timeout mid-stream
        acc.error = f"stream interrupted: {type(e).__name__}: {e}"
    return acc.finish(time.perf_counter(), resp.status_code)


def stream_request(session: Any, base_url: str, path: str, body: dict[str, Any], *,
                   headers: dict[str, str] | None = None, timeout: float = 600.0) -> RequestRecord:
    """Send one streamed request with a plain `requests.Session` (used outside Locust)."""
    start_time, t_start = time.time(), time.perf_counter()
    try:
        resp = session.post(base_url.rstrip("/") + path, json=body, headers=headers, stream=True, timeout=timeout)
    except Exception as e:
        return RequestRecord(ok=False, error=f"{type(e).__name__}: {e}", start_time=start_time,
                             e2el_ms=(time.perf_counter() - t_start) * 1000.0)
    with resp:
        return consume_stream(resp, t_start, start_time)
