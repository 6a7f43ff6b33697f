"""Turning emitted token ids into text deltas, with stop strings and stop tokens."""
from __future__ import annotations

from peagle_core.engine.request import Request


class TextState:
    """Decodes a request's output incrementally enough for streaming.

    Text is re-decoded from the output ids (simple and exact for byte-level BPE); a trailing
    replacement character (an incomplete UTF-8 sequence) and any suffix that could still grow
    into a stop string are held back until they resolve.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.text, self.sent = "", 0

    def update(self, req: Request) -> tuple[str, bool]:
        """Returns (new text to emit, whether a stop string ended the request)."""
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(req.output_ids)
        hit = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            self.text = text[:hit]
            return self._emit(len(self.text)), True
        self.text = text
        safe = len(text)
        if not req.finished:
            while safe and text[safe - 1] == "\ufffd":
                safe -= 1
            safe -= max((n for s in self.stops for n in range(len(s) - 1, 0, -1) if text[:safe].endswith(s[:n])),
                        default=0)
        return self._emit(safe), False

    def _emit(self, upto: int) -> str:
        delta = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return delta
