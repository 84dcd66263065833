"""Incremental detokenization with stop strings, for streamed and whole responses.

A token's text can depend on its neighbours (SentencePiece decoders drop the space that
starts a sequence; a character's UTF-8 bytes may come in several tokens), so new tokens are
decoded in a short window: the text of tokens [prefix, end) less that of [prefix, read),
where [prefix, read) are the few tokens before the new ones, already released. The first
window's context is the prompt's last tokens (decoded alone, a completion would lose the
space it starts with: " Paris" coming back as "Paris"). A window whose text ends in U+FFFD
(an incomplete UTF-8 sequence) waits for the next token; once it does not, its text is
final and the window moves on. Each token is decoded a bounded number of times, so a long
answer costs linear time on the HTTP loop, not quadratic (decoding the whole output again
per message did).

Text is released only when it can no longer change: besides the window that waits, any
tail that could still grow into a stop string is held back. When a stop string appears,
the text before it is final and the request is ended (the stop string itself is not
returned, as OpenAI does); the search covers only text not searched before, plus a stop
string's length of overlap. A model without a tokenizer (token-id prompts only) has no
text: every delta is empty.
"""

from __future__ import annotations

from collections.abc import Sequence

CONTEXT_TOKENS = 5  # prompt tokens decoded in front of the first new ones


class TextStream:
    def __init__(self, tokenizer, stops: list[str], prompt_ids: Sequence[int] = ()) -> None:
        self.decode = tokenizer.decode if tokenizer is not None else (lambda ids: "")
        self.stops = stops
        context = list(prompt_ids[-CONTEXT_TOKENS:]) if tokenizer is not None else []
        if self.decode(context).endswith("\ufffd"):  # ends mid-character: no clean cut
            context = []
        self.ids: list[int] = context  # the context, then every generated token
        self.start = len(context)  # where the generated tokens begin
        self.prefix, self.read = 0, len(context)  # the window's context is [prefix, read)
        self.text = ""  # the generated text whose tokens left the window
        self.sent = 0  # characters of it already released
        self.searched = 0  # characters of it already searched for stop strings
        self.stopped = False
        self._longest_stop = max(map(len, stops), default=0)

    def _settle(self, final: bool) -> None:
        """The window's new text joins `self.text` unless it ends mid-character (or at
        the end of generation, whatever it is)."""
        if len(self.ids) == self.read:
            return
        before = self.decode(self.ids[self.prefix : self.read])
        window = self.decode(self.ids[self.prefix :])
        if not final and (window.endswith("\ufffd") or len(window) <= len(before)):
            return  # wait for the next token
        if window.startswith(before):
            self.text += window[len(before) :]
        else:  # a decoder that rewrote the context's text: decode the whole output again
            self.text = self.decode(self.ids[self.start :])
        self.prefix, self.read = self.read, len(self.ids)

    def _held_back(self, text: str) -> int:
        hold = 0
        for stop in self.stops:  # longest tail that is a proper prefix of a stop string
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def _release(self, final: bool) -> str:
        text = self.text
        start = max(0, self.searched - self._longest_stop + 1)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        self.searched = len(text)
        if hits:
            self.stopped = True
            end = min(hits)
        else:
            end = len(text) if final else len(text) - self._held_back(text)
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def take(self, token_ids: list[int]) -> tuple[str, int]:
        """`add`, a token at a time while stop strings are watched -> (the new text, how
        many of `token_ids` it used: all, or up to the one that completed a stop string;
        the tokens after it were never part of the answer, nor of its usage)."""
        if not self.stops or self.stopped:
            return self.add(token_ids), 0 if self.stopped else len(token_ids)
        out = []
        for i, token in enumerate(token_ids):
            out.append(self.add([token]))
            if self.stopped:
                return "".join(out), i + 1
        return "".join(out), len(token_ids)

    def add(self, token_ids: list[int]) -> str:
        """New text that is safe to release; sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        self._settle(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once generation ended without a stop string."""
        if self.stopped:
            return ""
        self._settle(final=True)
        return self._release(final=True)
