"""Incremental detokenization and stop strings, shared by `LLM.generate` and the server's streams.

`IncrementalDetokenizer` turns tokens into text deltas without ever handing out part of a multi-byte character: it
decodes a short window of recent tokens twice (with and without the newest) and emits the difference only when the
window no longer ends in U+FFFD (the decoder's mark for an incomplete UTF-8 sequence). With byte-level BPE the
concatenated deltas equal `decode(all tokens)` exactly; `flush()` gives what a final incomplete character left.

`StopStrings` finds the first stop string in the text as it grows (a match may span tokens) and says how much of
the text's tail must be held back from a stream because it could still become a stop string."""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode):
        """decode: token ids -> text (the codec's)."""
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # window start: tokens before it are fully emitted
        self.read = 0  # tokens [prefix, read) are emitted; their text is the window's known head

    def push(self, token: int) -> str:
        """Add one token; returns the text it completes ("" while a character is still incomplete)."""
        self.ids.append(int(token))
        head = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if len(text) <= len(head) or text.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(head):]

    def flush(self) -> str:
        """The text of tokens not emitted yet (an incomplete character as U+FFFD); the stream ends after it."""
        head = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(head):]


class StopStrings:
    def __init__(self, stops):
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """The earliest stop string in text that ends at or after text[new_from] (earlier text was searched
        before): (its start, the string), or None."""
        best = None
        for s in self.stops:
            i = text.find(s, max(0, new_from - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def held(self, text: str) -> int:
        """Characters at the end of text that are a proper prefix of some stop string (not streamed yet)."""
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
