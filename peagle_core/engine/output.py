"""A request's output: its emitted ids detokenised once, a chat reply split into harmony's channels, the text
the user sees cut at stop strings; and the one place `RequestOutput` is built.

Every front end reads this: `LLM.generate` / `LLM.chat` (whole outputs), `AsyncLLM` (deltas) and through it the
server. A completion's user-visible text is its decoded text; a chat reply's is its content (the final channel):
stop strings apply to that, as vLLM applies them to what it returns. vLLM's `min_tokens`: the text of the first
`min_tokens` output tokens is not searched for stop strings (a stop string that ends after them is found).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from peagle_core.engine.request import Request
from peagle_core.engine.types import CompletionOutput, RequestOutput, SamplingParams
from peagle_core.loading.harmony import HarmonyParser, merge_calls, supports_harmony
from peagle_core.loading.tokenizer import IncrementalDetokenizer, StopFilter


@dataclass
class Delta:
    """What one step added to a request's visible output."""

    text: str = ""  # a completion's text, a chat reply's content
    reasoning: str = ""  # chat: the analysis channel
    tool_calls: list[dict] = field(default_factory=list)  # chat: {"index", "name" (a call's first piece), "arguments"}


class OutputState:
    """One request's streamed output. `chat_prefix` (None: a completion) is the text the reply continues after
    harmony's `<|start|>assistant`, e.g. a forced tool call's header."""

    def __init__(self, tokenizer, params: SamplingParams, chat_prefix: str | None = None):
        harmony = chat_prefix is not None and supports_harmony(tokenizer)
        # a chat reply on harmony's tokens keeps them: its markers split it (a plain tokenizer's text is parsed as is)
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens and not harmony) \
            if tokenizer is not None else None
        self.parser = HarmonyParser() if chat_prefix is not None else None
        self._primed = self.parser.feed(f"<|start|>assistant{chat_prefix}").tool_calls if harmony else []
        self.filter = StopFilter(params.stop, params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens
        self.num_ids = 0
        self._reasoning: list[str] = []
        self.calls: list[dict] = []  # whole calls so far: {"name", "arguments"}

    @property
    def stopped(self) -> bool:
        return self.filter.stopped

    def update(self, req: Request) -> Delta:
        """The request's ids since the last update -> what it adds to the output (`stopped` turns True at a stop
        string; the caller finishes the request)."""
        if self.detok is None:
            return Delta()
        new = req.token_ids[req.num_prompt + self.num_ids:]  # only the new ids: the whole output each step is O(n^2)
        early = max(0, min(len(new), self.min_tokens - self.num_ids))  # output positions <= min_tokens
        self.num_ids = req.num_output
        a = self._push(new[:early], check=False, final=False) if early else Delta()
        b = self._push(new[early:], check=True, final=req.finished)
        d = Delta(a.text + b.text, a.reasoning + b.reasoning, merge_calls(self._primed + a.tool_calls + b.tool_calls))
        self._primed = []
        self._record(d)
        return d

    def _push(self, ids: list[int], check: bool, final: bool) -> Delta:
        text = self.detok.push(ids) + (self.detok.flush() if final else "")
        if self.parser is None:
            return Delta(self.filter.push(text, final, check))
        content, reasoning, calls = self.parser.feed(text, final=final)
        return Delta(self.filter.push(content, final, check), reasoning, calls)

    def _record(self, d: Delta) -> None:
        if d.reasoning:
            self._reasoning.append(d.reasoning)
        for c in d.tool_calls:
            if "name" in c:
                self.calls.append({"name": c["name"], "arguments": c["arguments"]})
            else:
                self.calls[c["index"]]["arguments"] += c["arguments"]

    @property
    def text(self) -> str:
        return self.filter.emitted

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)


def delta_output(req: Request, new_ids: list[int], delta: Delta, new_logprobs: list[dict] | None) -> RequestOutput:
    """One step's output of a request, as a stream sends it (vLLM's DELTA outputs)."""
    return _request_output(req.request_id, req, copy.deepcopy(req.stats), [CompletionOutput(
        0, delta.text, new_ids, req.finish_reason, new_logprobs, delta.reasoning or None, delta.tool_calls or None)])


def final_output(request_id: str, samples: list[Request]) -> RequestOutput:
    """A finished request's whole output: one choice per sample of its prompt (n), in order."""
    choices, stats = [], copy.deepcopy(samples[0].stats)
    for i, r in enumerate(samples):
        if i:
            stats.merge(r.stats)
        out = r.output
        chat = out is not None and out.parser is not None
        choices.append(CompletionOutput(i, out.text if out is not None else "", r.output_ids, r.finish_reason,
                                        r.logprobs, (out.reasoning or None) if chat else None,
                                        out.calls if chat else None))
    return _request_output(request_id, samples[0], stats, choices, all(r.finished for r in samples))


def _request_output(request_id: str, r: Request, stats, choices: list[CompletionOutput],
                    finished: bool | None = None) -> RequestOutput:
    return RequestOutput(
        request_id, r.prompt, r.prompt_token_ids, choices, finished=r.finished if finished is None else finished,
        spec_decode_stats=stats,
        num_cached_tokens=r.num_cached_tokens or 0,
        metrics={"arrival_time": r.arrival_time, "first_scheduled_time": r.first_scheduled_time or 0.0,
                 "first_token_time": r.first_token_time or 0.0, "finished_time": r.finished_time or 0.0,
                 "num_prompt_tokens": r.num_prompt, "num_generated_tokens": r.num_output,
                 "num_preemptions": r.num_preemptions, "num_steps": r.num_steps})
