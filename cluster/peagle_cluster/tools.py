"""The replica's tool-call deltas in OpenAI's shapes: stream deltas with call ids, and whole calls.

The replica reports `{"index", "name", "arguments"}` pieces (name on a call's first piece only, see
`peagle_core.loading.harmony`); OpenAI streams a call as a first delta with `id`, `type` and the name,
then deltas that only add to `function.arguments`.
"""
from __future__ import annotations

import uuid
from typing import Any


class ToolCalls:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def delta(self, pieces: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Record pieces; returns them as OpenAI's `delta.tool_calls` entries."""
        out = []
        for p in pieces:
            i = p["index"]
            if "name" in p:
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": p["name"], "arguments": p["arguments"]}}
                self.calls.append(call)
                out.append({"index": i, **call, "function": dict(call["function"])})
            else:
                self.calls[i]["function"]["arguments"] += p["arguments"]
                out.append({"index": i, "function": {"arguments": p["arguments"]}})
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's `tool_calls` when the reply ended by calling (harmony's <|call|> is a stop token)."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason
