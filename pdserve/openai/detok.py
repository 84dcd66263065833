"""Incremental detokenization with stop strings, for streamed and whole responses.

The whole generated text is decoded again as tokens arrive (simple and exact: a token's
text can depend on its neighbours). Text is released only when it can no longer change:
a trailing U+FFFD (an incomplete UTF-8 sequence) and any tail that could still grow into a
stop string are held back. When a stop string appears, the text before it is final and the
request is ended (the stop string itself is not returned, as OpenAI does). A model without
a tokenizer (token-id prompts only) has no text: every delta is empty.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.decode = tokenizer.decode if tokenizer is not None else (lambda ids: "")
        self.stops = stops
        self.ids: list[int] = []
        self.sent = 0  # characters already released
        self.stopped = False

    def _held_back(self, text: str) -> int:
        hold = len(text) - len(text.rstrip("\ufffd"))
        for stop in self.stops:  # longest tail that is a proper prefix of a stop string
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def add(self, token_ids: list[int]) -> str:
        """New text that is safe to release; sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        text = self.decode(self.ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        else:
            end = len(text) - self._held_back(text)
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def finish(self) -> str:
        """The rest of the text once generation ended without a stop string."""
        if self.stopped:
            return ""
        text = self.decode(self.ids)
        delta = text[self.sent :]
        self.sent = len(text)
        return delta
