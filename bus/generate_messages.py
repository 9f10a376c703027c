"""What the gateway and a decode worker exchange: the generate request and the messages of its stream
(tokens, finish, error), with the usage and timings they report."""

from __future__ import annotations

import time
from typing import Annotated, Union

import msgspec

from bus.wire import ErrorCode, Msg, NonNegInt, Part, TokenId, TopLogprob
from engine.params import SamplingParams


class Usage(Part, kw_only=True):
    """Token counts, as in the OpenAI ``usage`` object plus the prefix-cache hits."""

    prompt_tokens: NonNegInt = 0
    completion_tokens: NonNegInt = 0
    cached_tokens: NonNegInt = 0


class Timings(Part, kw_only=True):
    """Seconds spent per phase of one request (0 where a phase did not happen).

    ``prefill_step`` is the engine step that computed the prompt (its last chunk) and sampled the
    first token, on whichever worker prefilled it: ``prefill`` minus it is the time spent around
    the compute (bus hops, hand-offs to the model thread, the KV transfer).
    """

    queue: float = 0.0
    prefill: float = 0.0
    transfer: float = 0.0
    decode: float = 0.0
    prefill_step: float = 0.0


class GenerateRequest(Msg, tag="generate_request", kw_only=True):
    """Gateway → decode worker (pool ``tandem.<model>.generate`` or targeted).

    ``stream_subject`` is where every StreamTokens / StreamFinish / StreamError goes.
    ``target_endpoint`` names a prefill worker (id or subject) chosen by the client.
    ``prompt`` lets a hand-written request (``nats pub``) send text instead of ids; the
    gateway always sends ``prompt_ids``. ``start_by`` (epoch seconds, 0: none) is the gateway's
    admission bound: a request that has not begun computing by then is dropped wherever it
    waits, with a ``queue_timeout`` StreamError. ``resume_ids`` are the tokens an earlier decode
    worker generated before it died (a migrated stream): they are output, not prompt (``max_tokens``,
    penalties and the seed's draw index count them), and ``shown_chars`` characters of their
    text have reached the client already.
    """

    request_id: str
    prompt_ids: list[TokenId] = []
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream_subject: str
    gateway_id: str = ""
    deadline: float = 0.0
    start_by: float = 0.0
    resume_ids: list[TokenId] = []
    shown_chars: NonNegInt = 0
    target_endpoint: str | None = None
    model: str = ""
    created: float = msgspec.field(default_factory=time.time)
    prompt: str | None = None


class _StreamMsg(Msg, kw_only=True):
    """Base of the messages on one request's stream subject (decode worker → gateway).

    ``seq`` starts at 0 and grows by one per message of the request's stream (tokens,
    finish and error share the counter), so the gateway can detect gaps and duplicates.
    Every one names its sender: ``worker_id`` and ``incarnation`` (its process). The gateway
    shows a message only when it comes from the worker holding the request (the one it sent the
    request to, or the one that admitted it from the pool), so a process that may publish on
    stream subjects cannot write into another worker's answers.
    """

    request_id: str
    seq: NonNegInt = 0
    worker_id: str = ""
    incarnation: str = ""


class StreamTokens(_StreamMsg, tag="stream_tokens", kw_only=True):
    """The tokens of one or more steps, in order.

    Message 0 carries no tokens: it says the request was admitted, so the gateway knows whose
    liveness to watch while the prompt is prefilled (and binds a pool request to its worker).
    ``logprobs[i]`` belongs to ``token_ids[i]``; ``top_logprobs[i]`` is its
    ``[token_id, logprob]`` list.
    """

    token_ids: list[TokenId]
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None


class StreamFinish(_StreamMsg, tag="stream_finish", kw_only=True):
    """The last message of a successful (or cancelled) request.

    ``finish_reason`` is ``stop``, ``length`` or ``cancelled``; ``prefill_mode`` says
    how the prompt was computed: ``remote``, ``local`` (decode worker) or ``aggregate``, and
    ``prefill_reason`` why there (``actors/prefill_choice.py``); a remote prefill's KV came as
    ``kv_bytes`` through ``kv_transfer`` (``shm``, ``tcp``, ``nixl``, ...).
    """

    finish_reason: str
    usage: Usage = msgspec.field(default_factory=Usage)
    timings: Timings = msgspec.field(default_factory=Timings)
    prefill_mode: str | None = None
    prefill_worker_id: str | None = None
    prefill_reason: str = ""
    kv_bytes: NonNegInt = 0
    kv_transfer: str = ""
    text: str = ""


class StreamError(_StreamMsg, tag="stream_error", kw_only=True):
    """The request failed; ``status`` is the HTTP status to report."""

    code: str = ErrorCode.INTERNAL
    message: str
    status: Annotated[int, msgspec.Meta(ge=400, le=599)] = 500


class StreamSender(msgspec.Struct):
    """Who a stream message says it is from, read from any JSON object (a message of a newer schema too)."""

    request_id: str = ""
    worker_id: str = ""
    incarnation: str = ""


#: The messages of one request's stream subject.
StreamMessage = Union[StreamTokens, StreamFinish, StreamError]  # noqa: UP007


def sender_of(data: bytes | bytearray | memoryview | str) -> StreamSender:
    """The sender a stream message names, read leniently (empty when the data says nothing readable)."""
    try:
        return msgspec.json.decode(data, type=StreamSender)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return StreamSender()
