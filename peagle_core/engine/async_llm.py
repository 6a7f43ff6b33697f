"""Async streaming engine for servers: submit, iterate deltas, abort.

The engine loop runs in its own thread; asyncio callers talk to it through an inbox (adds,
aborts) and per-request queues (deltas). A request whose consumer stops iterating is aborted,
freeing its KV blocks at once.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any, AsyncIterator

from peagle_core.config import EngineConfig, parse_engine_config
from peagle_core.engine.llm_engine import LLMEngine, StepError, Update
from peagle_core.engine.output import delta_output
from peagle_core.engine.types import RequestOutput, SamplingParams


class EngineError(RuntimeError):
    """The engine failed while running this request (other requests are unaffected)."""


class EngineDeadError(RuntimeError):
    """The engine loop is dead or stuck; the replica should be replaced."""


class AsyncLLM:
    def __init__(self, config: EngineConfig, stall_timeout_s: float = 120.0, **engine_kw: Any):
        self.engine = LLMEngine(config, **engine_kw)
        self.config, self.stall_timeout_s = config, stall_timeout_s
        self._inbox: deque[tuple[str, Any]] = deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._fatal: BaseException | None = None
        self._last_progress = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="peagle-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> "AsyncLLM":
        return cls(parse_engine_config(**kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.config.model

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ------------------------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       chat_prefix: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one sample's deltas (`engine.output`); `chat_prefix`: a harmony chat reply, as `OutputState`."""
        self.check_health()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = await asyncio.to_thread(self.engine.make_request, request_id, prompt, params, chat_prefix)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._post("add", req)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post("abort", request_id)

    async def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def check_health(self) -> None:
        if self._fatal is not None:
            raise EngineDeadError(f"engine loop died: {type(self._fatal).__name__}: {self._fatal}")
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        try:
            busy = self.engine.has_work() or self._inbox
        except Exception as e:  # e.g. a tensor-parallel worker died: dead, though the loop may not know yet
            raise EngineDeadError(f"engine is dead: {type(e).__name__}: {e}") from e
        if busy and time.monotonic() - self._last_progress > self.stall_timeout_s:
            raise EngineDeadError(f"engine made no progress for {self.stall_timeout_s:.0f} s")

    def stats(self) -> dict:
        return self.engine.engine_stats()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; streams still open end with finish_reason "abort"."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout_s)
        for rid in list(self._streams):
            self._deliver(rid, EngineError("engine shut down"))
        if not self._thread.is_alive():  # never while a step may still be talking to the workers
            self.engine.shutdown()       # tensor-parallel workers stop now (a no-op at TP=1)

    # ------------------------------------------------------------------------------------------

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.append((kind, payload))
        self._wake.set()

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if not self.engine.has_work():
                    self._last_progress = time.monotonic()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                try:
                    updates = self.engine.step()
                except StepError as e:
                    for req in e.requests:
                        self._deliver(req.request_id, EngineError(str(e)))
                    updates = []
                self._last_progress = time.monotonic()
                for u in updates:
                    self._deliver(u.req.request_id, delta_output(u.req, u.new_token_ids, u.delta, u.new_logprobs))
        except BaseException as e:  # a bug in the loop itself: fail everyone, report dead
            self._fatal = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine loop died: {e}"))

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                if payload.request_id in self._streams:  # its consumer may already be gone
                    self.engine.submit(payload)
            else:
                self.engine.abort(payload)

    def _deliver(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, item)
