"""Turning emitted token ids into text deltas, with stop strings."""
from __future__ import annotations

from peagle_core.engine.request import Request
from peagle_core.loading.tokenizer import IncrementalDetokenizer, StopFilter


class TextState:
    """One request's streamed text: incremental detokenization, then the stop-string filter."""

    def __init__(self, tokenizer, stops: list[str], include_stop: bool = False, skip_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.filter = StopFilter(stops, include_stop)
        self.num_ids = 0

    def update(self, req: Request) -> tuple[str, bool]:
        """Returns (new text to emit, whether a stop string ended the request)."""
        if self.detok is None:
            return "", False
        start = req.num_prompt + self.num_ids  # only the new ids: copying the whole output every step is O(n^2)
        text = self.detok.push(req.token_ids[start:])
        self.num_ids = req.num_output
        if req.finished:
            text += self.detok.flush()
        delta = self.filter.push(text, final=req.finished)
        return delta, self.filter.stopped
