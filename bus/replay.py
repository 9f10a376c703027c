"""What a worker published lately, by key, so a receiver that missed some can have it again.

Why: core NATS delivers at most once. A message published while its receiver was away (the receiver's
member died and it failed over to another, or the sender's own connection broke with bytes still in it) is
gone. The senders that matter keep what they sent: a decode worker every stream message of a request (its
tokens, its end), a prefill worker its answers to a job. A receiver that sees a gap in the ``seq`` numbers,
hears nothing for a while, or has just reconnected publishes a :class:`~bus.control_messages.Replay`; the sender
publishes the kept messages again, unchanged, and the receiver drops what it already had by ``seq``.

A key is kept while it is open and ``keep_s`` seconds after its last message (a finish, an error, a
``PrefillDone``), so a receiver has that long to come back.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Sent:
    #: (subject, seq, encoded message, its NATS headers)
    messages: list[tuple[str, int, bytes, dict[str, str] | None]] = field(default_factory=list)
    first_seq: int = 0  # the seq of messages[0] (a receiver asking for an earlier one cannot have it)
    ended_at: float | None = None
    nbytes: int = 0


class SentLog:
    """Messages published per key, kept until ``keep_s`` after the key's last message (``end``).

    Bounded: at most ``max_keys`` keys and ``max_bytes`` of messages, the keys that ended going first (the
    oldest first), then, only past that, the least recently used open ones; and at most ``max_messages``
    per key (the oldest go: a receiver that falls that far behind cannot catch up, and :meth:`since` says so).
    """

    def __init__(self, keep_s: float = 60.0, max_keys: int = 4096, max_messages: int = 65536,
                 max_bytes: int = 64 << 20, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s, self.max_keys, self.max_messages, self.max_bytes = keep_s, max_keys, max_messages, max_bytes
        self.clock = clock
        self._keys: OrderedDict[str, _Sent] = OrderedDict()  # least recently used first
        self._ended: OrderedDict[str, None] = OrderedDict()  # keys that ended, oldest end first
        self._bytes = 0
        self._next_expiry = 0.0

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def record(self, key: str, subject: str, seq: int, data: bytes, headers: dict[str, str] | None = None, *,
               end: bool = False) -> None:
        """``data`` (an encoded message, ``seq`` in its key's order) went to ``subject`` with ``headers``;
        ``end``: the key's last."""
        now = self.clock()
        self._expire(now)
        sent = self._keys.get(key)
        if sent is None:
            sent = self._keys[key] = _Sent(first_seq=seq)
        self._keys.move_to_end(key)
        sent.messages.append((subject, seq, data, headers))
        sent.nbytes += len(data)
        self._bytes += len(data)
        if len(sent.messages) > self.max_messages:
            dropped = sent.messages.pop(0)[2]
            sent.nbytes -= len(dropped)
            self._bytes -= len(dropped)
            sent.first_seq = sent.messages[0][1]
        if end:
            sent.ended_at = now
            self._ended[key] = None
        while len(self._keys) > self.max_keys or (self._bytes > self.max_bytes and len(self._keys) > 1):
            self._forget(next(iter(self._ended)) if self._ended else next(iter(self._keys)))

    def since(self, key: str, from_seq: int) -> tuple[list[tuple[str, bytes, dict[str, str] | None]], bool] | None:
        """The kept ``(subject, data, headers)`` of ``key`` from ``from_seq`` on and whether that is all of them
        (False: some were dropped for ``max_messages``); None for a key not kept here."""
        self._expire(self.clock())
        sent = self._keys.get(key)
        if sent is None:
            return None
        kept = [(subj, data, hdrs) for subj, seq, data, hdrs in sent.messages if seq >= from_seq]
        return kept, from_seq >= sent.first_seq

    def _expire(self, now: float) -> None:
        """Forget keys that ended more than ``keep_s`` ago (looked at once a second at most)."""
        if now < self._next_expiry:
            return
        self._next_expiry = now + 1.0
        while self._ended:
            key = next(iter(self._ended))
            if now - self._keys[key].ended_at <= self.keep_s:  # type: ignore[operator]
                break
            self._forget(key)

    def _forget(self, key: str) -> None:
        sent = self._keys.pop(key)
        self._ended.pop(key, None)
        self._bytes -= sent.nbytes
