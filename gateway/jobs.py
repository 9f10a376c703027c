"""What a prepared request is: its prompts as token ids and one :class:`Job` per choice, with each job's state.

Plain data: ``gateway.prepare`` makes a :class:`Prepared` from a request body, ``gateway.run`` sends its jobs and
fills them in from their streams, ``gateway.service`` admits them, ``gateway.responses`` prints them. This module
imports none of them, so each of them can import it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from bus.generate_messages import Usage
from engine.params import SamplingParams
from gateway.tools import ToolSet

#: a stream silent this long asks its worker for what it may have missed (doubling up to ``ASK_AGAIN_MAX_S``
#: while it stays silent): a message lost in a NATS failover is otherwise noticed at the next one, or never
ASK_AGAIN_S = 2.0
ASK_AGAIN_MAX_S = 8.0

Kind = Literal["chat", "completion"]


@dataclass
class Prepared:
    """A validated request: token ids per prompt, one job per choice, output options."""

    kind: Kind
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str]
    jobs: list[Job]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: bool
    top_logprobs: int
    echo: bool
    target_endpoint: str | None
    timeout: float
    tools: ToolSet | None = None

    @property
    def parses_tool_calls(self) -> bool:
        return self.tools is not None and self.tools.active


@dataclass
class Job:
    """One generated sequence: a prompt and one of its ``n`` choices."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    hashes: list[bytes]
    sampling: SamplingParams
    request_id: str = ""
    worker_id: str | None = None
    worker_incarnation: str = ""  # the process of ``worker_id`` holding the job, when known
    route_reason: str = ""
    pooled: bool = False  # sent to the pool: its worker is whichever admitted it
    retried: bool = False
    migrations: int = 0  # times it moved to another decode worker mid-stream
    queued: bool = False  # when dispatched, every place was taken: it had to wait (admission's measurements)
    next_seq: int = 0
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    decode_worker: str = ""
    prefill: str = ""  # "remote:<prefill worker>", "local" or "aggregate"
    prefill_reason: str = ""  # why there (actors/prefill_choice.py)
    kv_bytes: int = 0  # a remote prefill's KV, and the mechanism that carried it
    kv_transfer: str = ""
    done: bool = False
    started: float = field(default_factory=time.monotonic)
    start_by: float = 0.0  # epoch seconds: not begun by then, it is dropped where it waits
    first_token_s: float | None = None
    last_token_at: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # seconds between token messages
    heard_at: float = field(default_factory=time.monotonic)  # its last message in order (or its dispatch)
    asked_at: float = 0.0  # when its worker was last asked to publish its stream again
    ask_every: float = ASK_AGAIN_S
    gap_since: float | None = None  # a message ahead of ``next_seq`` came: the ones between are asked for

    @property
    def text(self) -> str:
        """The completion so far."""
        return "".join(self.text_parts)

    def holder_mismatch(self, worker_id: str, incarnation: str) -> str:
        """Why a stream message signed by ``worker_id`` / ``incarnation`` is not from the worker holding this job
        ('' when it is).

        The holder is the worker the job was sent to, or for a pool job the first that names itself (its
        admission notice); its process (incarnation) is learnt from its load reports or that first message.
        """
        if not worker_id:
            return "unsigned"
        if self.worker_id is None:
            self.worker_id, self.worker_incarnation = worker_id, incarnation
            return ""
        if worker_id != self.worker_id:
            return "other_worker"
        if not self.worker_incarnation:
            self.worker_incarnation = incarnation
        elif incarnation != self.worker_incarnation:
            return "other_process"
        return ""


@dataclass
class Event:
    """Something that happened to one job: new tokens, or its end."""

    kind: Literal["tokens", "finish"]
    job: Job
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
