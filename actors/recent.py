"""A worker's latest KV transfers and prefill decisions, answered on its ``recent`` micro endpoint.

Why: ``tandem status --json`` and the page's cluster view show what moved between the workers and
where prompts were prefilled, live, from the workers themselves (``bus/discovery.py`` asks every
worker), with no store to keep: a bounded list per worker is enough to see the last minutes.
"""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

#: entries kept per kind
KEEP = 50


class RecentWork:
    """The last :data:`KEEP` transfers into this worker's pool and prefill decisions it made."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.transfers: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self.transfers_total = 0

    def transfer(self, request_id: str, source: str, engine: str, nbytes: int, seconds: float) -> None:
        """A prefill worker's KV landed here: ``nbytes`` through ``engine``, written in ``seconds`` (the first byte
        sent to the last landed, as the writer measured it)."""
        self.transfers_total += 1
        self.transfers.append({"at": time.time(), "request_id": request_id, "from": source, "to": self.worker_id,
                               "engine": engine, "bytes": nbytes, "seconds": seconds})

    def decision(self, request_id: str, mode: str, reason: str, tokens: int) -> None:
        """Where a prompt of ``tokens`` tokens is prefilled (``local`` or ``remote``), and why."""
        self.decisions.append({"at": time.time(), "worker": self.worker_id, "request_id": request_id,
                               "mode": mode, "reason": reason, "tokens": tokens})

    def to_json(self, paths: dict[str, str]) -> bytes:
        """The endpoint's answer, newest first; ``paths`` are the peers this worker writes KV to, by mechanism."""
        return json.dumps({"transfers": list(reversed(self.transfers)), "decisions": list(reversed(self.decisions)),
                           "transfers_total": self.transfers_total,
                           "paths": [{"from": self.worker_id, "to": peer, "engine": mech}
                                     for peer, mech in sorted(paths.items())]}).encode()
