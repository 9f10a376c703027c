"""What a decode worker keeps of each generate request it holds: the message, the stream's next sequence number,
where its prompt is computed and why, and the times and sizes its `StreamFinish` reports.

Plain data; `actors.decode` fills it in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from actors.remote_prefill import RemotePrefill
from bus.generate_messages import GenerateRequest


class RequestFailed(Exception):
    """A request refused at admission: ``code``, ``message`` and HTTP ``status`` go to its gateway (StreamError)."""

    def __init__(self, code: str, message: str, status: int) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


@dataclass
class Request:
    """One request this worker holds, from its admission to its last stream message."""

    req: GenerateRequest
    prompt_ids: list[int]
    accepted: float = field(default_factory=time.time)
    seq: int = 0  # next stream sequence number
    mode: str = "local"
    prefill_reason: str = ""
    prefill_worker: str | None = None
    first_token_at: float | None = None
    transfer_s: float = 0.0
    prefill_s: float = 0.0
    prefill_step_s: float = 0.0  # the engine step that computed the prompt (its last chunk), wherever it ran
    kv_bytes: int = 0  # a remote prefill's KV that landed here, and how
    kv_transfer: str = ""
    uncached: int = 0  # prompt tokens not in this worker's prefix cache when the prefill was placed
    local_started: float | None = None  # when a local prefill was handed to the engine (to learn its cost)
    in_engine: bool = False
    remote: RemotePrefill | None = None  # until a prefill worker's computing of the prompt has settled
    cancelled: bool = False
    begun: bool = False  # computing started once (a prefill worker took a job, or the engine placed it)
