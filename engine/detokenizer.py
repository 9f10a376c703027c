"""Incremental detokenization with stop strings: O(new tokens) of work per step.

Each step decodes only a short window (a few context tokens plus the uncommitted ones) and keeps in
memory only the text that is not yet shown: a tail that could still become a stop string, or an
incomplete UTF-8 character. Everything shown is final; the whole text is joined only when asked.
"""

from __future__ import annotations

from engine.tokenizer import TextTokenizer

CONTEXT_TOKENS = 4  # tokens decoded before the new ones, for the decoder's context (word starts)
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.read = 0  # tokens whose text is committed (ends in whole characters)
        self.committed = 0  # characters of committed text
        self.shown = 0  # characters handed out so far
        self.base = 0  # characters before `buffer` (all shown, kept in `parts`)
        self.buffer = ""  # text from `base` on: committed, then the uncommitted tokens' text
        self.parts: list[str] = []
        self.stopped = False  # a stop string was found; the text ends before it

    @property
    def text(self) -> str:
        """The text so far (cut before a stop string)."""
        return "".join(self.parts) + self.buffer

    def add(self, ids: list[int], final: bool = False) -> str:
        """`ids` is the whole output, ending with the new tokens; returns the text that is safe to show now.

        Unless `final`, holds back an incomplete character and a tail that may grow into a stop string.
        """
        if self.stopped:
            return ""
        start = max(0, self.read - CONTEXT_TOKENS)
        stable = self.tokenizer.decode(ids[start:self.read])
        window = self.tokenizer.decode(ids[start:])
        if window.startswith(stable):
            new = window[len(stable):]
        else:  # a decoder that rewrites earlier text: take the whole decode past what is committed
            new = self.tokenizer.decode(ids)[self.committed:]
        kept = self.committed - self.base
        self.buffer = self.buffer[:kept] + new
        if not new.endswith(_INCOMPLETE):
            self.read, self.committed = len(ids), self.committed + len(new)
        return self._show(final)

    def resume(self, ids: list[int], shown: int) -> None:
        """Continue an output generated elsewhere (a migrated request) whose first `shown` characters
        were handed out there: the rest comes out with the next token."""
        self.add(ids)
        full = self.text
        self.parts, self.buffer, self.base = [], full, 0
        self.shown = min(shown, len(full))
        self._trim()

    def flush(self) -> str:
        """The output ended (no new token): everything not shown yet."""
        return "" if self.stopped else self._show(final=True)

    def _show(self, final: bool) -> str:
        buf, from_ = self.buffer, self.shown - self.base
        # A stop string cannot start in shown text (its tail was held back), so search the rest.
        hits = [i for i in (buf.find(s, from_) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self.buffer = buf[: min(hits)]
            end = len(self.buffer)
        else:
            end = len(buf)
            while not final and end > from_ and buf[end - 1] == _INCOMPLETE:
                end -= 1
            if not final:
                end -= self._stop_prefix(buf, from_, end)
        delta = buf[from_:end] if end > from_ else ""
        self.shown = self.base + max(from_, end)
        self._trim()
        return delta

    def _stop_prefix(self, buf: str, from_: int, end: int) -> int:
        """Length of the longest tail of buf[from_:end] that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, end - from_), longest, -1):
                if buf[end - k:end] == stop[:k]:
                    longest = k
                    break
        return longest

    def _trim(self) -> None:
        """Move shown, committed text out of the working buffer."""
        cut = min(self.shown, self.committed) - self.base
        if cut > 0:
            self.parts.append(self.buffer[:cut])
            self.buffer = self.buffer[cut:]
            self.base += cut
