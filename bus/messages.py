"""Every message tandem puts on NATS, as msgspec structs serialised as JSON.

Why JSON: a person with the ``nats`` CLI can read (``nats sub 'tandem.>'``) and drive
(``nats pub``) the system. KV bytes never travel here, so JSON's cost is small.

Each message carries

* ``kind``: a tag naming the message type (``"generate_request"``, ``"stream_tokens"`` …),
  so one subscriber can tell apart the messages of one subject (:func:`decode_any`);
* ``v``: the schema version. Adding an optional field does not bump it (unknown fields
  are ignored on decode, missing optional ones take their defaults); a change that an
  old reader would misread does, and :func:`decode` refuses versions newer than its own.

The request id also travels in the ``Tandem-Request-Id`` NATS header (:func:`headers`),
so tools can filter and correlate without parsing bodies.

Sizes: NATS refuses messages over the server's ``max_payload`` (1 MiB by default);
:func:`check_payload` and the publish helpers refuse them before sending with an error
naming the size and the limit, instead of a dropped connection or a silent timeout.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Union

import msgspec

from engine.params import SamplingParams

SCHEMA_VERSION = 1

#: NATS header carrying the request id of every request-scoped message.
REQUEST_ID_HEADER = "Tandem-Request-Id"
#: JetStream de-duplication header (a re-published job with the same id is stored once).
MSG_ID_HEADER = "Nats-Msg-Id"


class MessageError(ValueError):
    """A message could not be decoded: bad JSON, a wrong field, a wrong kind or version."""


class PayloadTooLarge(ValueError):
    """A message is over the server's ``max_payload`` and was not sent."""

    def __init__(self, size: int, limit: int, subject: str | None = None, header_bytes: int = 0) -> None:
        self.size = size
        self.limit = limit
        self.subject = subject
        where = f" for subject {subject!r}" if subject else ""
        parts = f" ({size - header_bytes} payload + {header_bytes} header bytes)" if header_bytes else ""
        super().__init__(
            f"message{where} is {size} bytes{parts}, over the NATS server's max_payload of {limit} bytes; "
            "refused before sending (raise max_payload in the server config, or send less: "
            "KV bytes go through a transfer engine, never over NATS)"
        )


# Error codes carried by PrefillDone.error_code and StreamError.code.
class ErrorCode:
    """Machine-readable error codes (strings, stable across versions)."""

    BAD_REQUEST = "bad_request"
    LAYOUT_MISMATCH = "layout_mismatch"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    OVERLOADED = "overloaded"
    UNKNOWN_TARGET = "unknown_target"
    TRANSFER_FAILED = "transfer_failed"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    WORKER_LOST = "worker_lost"
    HANDED_BACK = "handed_back"  # a draining worker gave the request back before its first token
    QUEUE_TIMEOUT = "queue_timeout"  # it did not start by its ``start_by`` time: dropped where it waited
    # a request_id already served (or being served): a copy of one request, or a hand-written request reusing
    # an id; the gateway never reuses ids, so to it this only says that a copy was dropped
    DUPLICATE_REQUEST = "duplicate_request"
    INTERNAL = "internal"


class _Msg(msgspec.Struct, kw_only=True, tag_field="kind"):
    """Base of every bus message: ``kind`` tag + ``v`` schema version."""

    v: int = SCHEMA_VERSION


class _Part(msgspec.Struct, kw_only=True):
    """Base of nested (untagged) parts of a message."""


NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
#: One (token id, logprob) pair, JSON ``[id, logprob]``.
TopLogprob = tuple[int, float]


class KVDestination(_Part, kw_only=True):
    """Where a prefill worker must write the KV: the decode worker's pre-allocated blocks.

    ``engine`` is the transfer engine (``nixl``, ``shm``, ``tcp``, ``cuda_ipc``, ``auto``);
    ``endpoint`` the subject answering with the pool's transfer metadata (NIXL agent blob,
    shm segment, host:port), fetched once per ``incarnation``, which
    changes when the decode worker restarts, so writes to a dead pool are refused.
    ``first_token_index`` is the first uncached prompt token: blocks cover tokens from
    there on (the prefix before it is already in the decode worker's cache). ``grant`` is the
    token the decode worker's pool made for these blocks and this attempt: an engine that takes
    writes from the network (TCP) refuses one without it (``kv.transfer.grants.WriteGrants``).
    """

    engine: str
    worker_id: str
    incarnation: str
    block_ids: list[NonNegInt]
    first_token_index: NonNegInt = 0
    endpoint: str | None = None
    grant: str = ""


class Usage(_Part, kw_only=True):
    """Token counts, as in the OpenAI ``usage`` object plus the prefix-cache hits."""

    prompt_tokens: NonNegInt = 0
    completion_tokens: NonNegInt = 0
    cached_tokens: NonNegInt = 0


class Timings(_Part, kw_only=True):
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


class GenerateRequest(_Msg, tag="generate_request", kw_only=True):
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


class PrefillJob(_Msg, tag="prefill_job", kw_only=True):
    """Decode worker → prefill worker (pool ``tandem.<model>.prefill`` or targeted).

    The prefill worker refuses a ``layout_fingerprint`` different from its own (the
    error names both ``layout`` dicts), computes the prompt, writes the KV for tokens
    ``dst.first_token_index`` onward into ``dst.block_ids`` and answers on
    ``reply_subject`` with a PrefillDone. ``attempt`` counts retries (0 first).
    """

    request_id: str
    prompt_ids: list[TokenId]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    layout_fingerprint: str
    layout: dict[str, Any] = {}
    dst: KVDestination
    reply_subject: str
    deadline: float = 0.0
    decode_worker_id: str = ""
    attempt: NonNegInt = 0
    model: str = ""
    created: float = msgspec.field(default_factory=time.time)


class PrefillAccepted(_Msg, tag="prefill_accepted", kw_only=True):
    """Prefill worker → decode worker, on the job's ``reply_subject``: I took this job.

    Why: a job from the pool names no worker; this tells the decode worker whose
    liveness to watch, so a worker that dies mid-job is noticed within seconds, not at
    the job's deadline. ``transfer`` names the mechanism that will carry the KV ("" when
    not known yet): the decode worker polls for landings only through one that needs it.
    """

    request_id: str
    attempt: NonNegInt = 0
    prefill_worker_id: str
    transfer: str = ""


class PrefillDone(_Msg, tag="prefill_done", kw_only=True):
    """Prefill worker → decode worker: the KV is written (ok) or why not.

    ``timings`` keys are seconds: ``queue`` (until its first engine step, in this worker's backlog and
    behind shorter prompts), ``compute`` (the engine steps it was in), ``step`` (the last of them),
    ``transfer`` (after the last step, until the KV landed), ``write`` (from the first KV byte sent until
    the last landed: with layer-wise streaming that overlaps the compute). ``transfer`` (the field) names
    the mechanism that carried the KV.
    ``first_top_logprobs`` is a list of ``[token_id, logprob]`` pairs.
    """

    request_id: str
    ok: bool
    first_token: TokenId | None = None
    first_logprob: float | None = None
    first_top_logprobs: list[TopLogprob] | None = None
    error: str | None = None
    error_code: str | None = None
    timings: dict[str, float] = {}
    prefill_worker_id: str = ""
    cached_tokens: NonNegInt = 0
    attempt: NonNegInt = 0
    layout_fingerprint: str | None = None
    # Whether any write into the destination blocks began. A failed job that wrote may still
    # have bytes in flight: the decode worker keeps those blocks quarantined until the deadline.
    wrote: bool = False
    transfer: str = ""


class _StreamMsg(_Msg, kw_only=True):
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


class Cancel(_Msg, tag="cancel", kw_only=True):
    """Anyone → ``tandem.cancel.<request>``: stop work and free the request's blocks."""

    request_id: str
    reason: str = ""


class Claim(_Msg, tag="claim", kw_only=True):
    """Worker → ``tandem.<model>.claim`` (JetStream, ``Nats-Msg-Id`` = ``key``): "I serve this".

    The claims stream stores the first claim of a key; a later one within its duplicate
    window is acknowledged as a duplicate, and that worker drops its copy of the work.
    """

    key: str
    request_id: str = ""
    worker_id: str = ""


class Replay(_Msg, tag="replay", kw_only=True):
    """Publish again what you sent for ``key`` from message ``from_seq`` on (``tandem.<model>.replay.stream``
    for decode workers, ``.prefill`` for prefill workers).

    Core NATS drops what is published while a receiver is away (its member died, its link failed over):
    a gateway that sees a gap in a request's stream, hears nothing for a while, or has just reconnected,
    asks the decode workers for the request's stream messages (``key`` = the request id, ``from_seq`` its
    next expected ``seq``); a decode worker waiting for a prefill's answer asks the prefill workers
    (``key`` = ``<request>:<attempt>``). Whoever sent them publishes them again, unchanged, to where they
    went; everybody else ignores the request. A receiver drops what it already had by ``seq``.
    """

    key: str
    from_seq: NonNegInt = 0
    requester: str = ""


class KVMetaRequest(_Msg, tag="kv_meta_request", kw_only=True):
    """Ask a worker (``tandem.kv.meta.<worker>``) for its transfer-engine metadata."""

    worker_id: str = ""
    engine: str | None = None


class KVMetaReply(_Msg, tag="kv_meta_reply", kw_only=True):
    """A worker's transfer-engine metadata.

    ``meta`` holds JSON-friendly facts (shm name, host:port, layout); ``blob`` carries an
    opaque binary such as a NIXL agent descriptor (base64 in JSON).
    """

    worker_id: str
    incarnation: str
    engine: str = ""
    meta: dict[str, Any] = {}
    blob: bytes | None = None


class WorkerStats(_Msg, tag="worker_stats", kw_only=True):
    """A worker's 1 Hz load report on ``tandem.stats.<role>.<worker>``."""

    role: str
    worker_id: str
    model: str = ""
    running: NonNegInt = 0
    queued: NonNegInt = 0
    free_blocks: NonNegInt = 0
    total_blocks: NonNegInt = 0
    prefix_hit_rate: float = 0.0
    uptime: float = 0.0
    incarnation: str = ""
    max_batch: NonNegInt = 0
    draining: bool = False  # stopping: route nothing new here
    #: decode_only: prompts it prefills locally only for want of a free prefill worker (bus/demand.py)
    deferred_prefills: NonNegInt = 0
    #: it keeps served prompts' blocks for later requests: only then does a router send it the same prefix again
    prefix_cache: bool = True
    #: the path that multiplies many rows of its weights (engine.native.kernel_path: avx512_bf16, avx2, ...)
    kernels: str = ""
    ts: float = msgspec.field(default_factory=time.time)


class RoleScale(_Part, kw_only=True):
    """One role in an :class:`AutoscaleState`."""

    role: str
    demand: NonNegInt = 0
    lag: NonNegInt = 0
    desired: NonNegInt = 0
    actual: NonNegInt = 0  # workers running and taking work
    draining: NonNegInt = 0
    min: NonNegInt = 0
    max: NonNegInt = 0
    last_action: str = ""


class AutoscaleState(_Msg, tag="autoscale_state", kw_only=True):
    """A local autoscaler's answer on ``tandem.autoscale.state`` (``tandem status`` shows it)."""

    scaler: str
    model: str = ""
    roles: list[RoleScale] = []
    ts: float = msgspec.field(default_factory=time.time)


#: Every message type, for decoding one whose kind is not known in advance.
AnyMessage = Union[  # noqa: UP007 - a runtime union object msgspec decodes into
    GenerateRequest,
    PrefillJob,
    PrefillAccepted,
    PrefillDone,
    StreamTokens,
    StreamFinish,
    StreamError,
    Cancel,
    Claim,
    Replay,
    KVMetaRequest,
    KVMetaReply,
    WorkerStats,
    AutoscaleState,
]
MESSAGE_TYPES: tuple[type[_Msg], ...] = AnyMessage.__args__  # type: ignore[attr-defined]
#: The messages of one request's stream subject.
StreamMessage = Union[StreamTokens, StreamFinish, StreamError]  # noqa: UP007

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder] = {}


def encode(msg: msgspec.Struct) -> bytes:
    """Serialise a message to JSON bytes."""
    return _encoder.encode(msg)


def kind_of(cls: type[msgspec.Struct]) -> str:
    """The ``kind`` tag of a message type."""
    return cls.__struct_config__.tag  # type: ignore[return-value]


def _type_name(type_: Any) -> str:
    args = getattr(type_, "__args__", None)
    if args:
        return " | ".join(getattr(a, "__name__", repr(a)) for a in args)
    return getattr(type_, "__name__", repr(type_))


def decode(data: bytes | bytearray | memoryview | str, type_: Any) -> Any:
    """Parse JSON bytes into ``type_`` (a message class or a union such as ``StreamMessage``).

    Raises :class:`MessageError` naming the expected type, the offending field path and
    the start of the data, for bad JSON, wrong/missing fields, a wrong ``kind`` or a
    schema version newer than this code understands.
    """
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        msg = dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raw = bytes(data) if not isinstance(data, str) else data.encode()
        preview = raw[:200].decode("utf-8", "replace")
        more = "…" if len(raw) > 200 else ""
        raise MessageError(f"cannot decode {_type_name(type_)}: {e} (data: {preview!r}{more})") from e
    v = getattr(msg, "v", SCHEMA_VERSION)
    if v > SCHEMA_VERSION:
        raise MessageError(
            f"{type(msg).__name__} has schema version {v}, newer than this tandem understands "
            f"({SCHEMA_VERSION}); upgrade this process"
        )
    return msg


def sender_of(data: bytes | bytearray | memoryview | str) -> StreamSender:
    """The sender a stream message names, read leniently (empty when the data says nothing readable)."""
    try:
        return msgspec.json.decode(data, type=StreamSender)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return StreamSender()


def decode_any(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse any tandem message, dispatching on its ``kind`` tag (for tail / debugging)."""
    return decode(data, AnyMessage)


def headers(request_id: str | None = None, msg_id: str | None = None, **extra: str) -> dict[str, str]:
    """NATS headers for a message: the request id, optionally a JetStream de-dup id."""
    h: dict[str, str] = {}
    if request_id:
        h[REQUEST_ID_HEADER] = request_id
    if msg_id:
        h[MSG_ID_HEADER] = msg_id
    h.update(extra)
    return h


def request_id_of(msg: Any) -> str | None:
    """The request id of a received NATS message (its header), or None."""
    hdrs = getattr(msg, "headers", None) or {}
    return hdrs.get(REQUEST_ID_HEADER)


def header_size(hdrs: dict[str, str] | None) -> int:
    """Bytes the headers take on the wire (``NATS/1.0\\r\\n`` + ``k: v\\r\\n``… + ``\\r\\n``)."""
    if not hdrs:
        return 0
    n = len(b"NATS/1.0\r\n") + 2
    for k, v in hdrs.items():
        n += len(k.encode()) + 2 + len(str(v).encode()) + 2
    return n


def check_payload(
    data: bytes | int, max_payload: int, subject: str | None = None, hdrs: dict[str, str] | None = None
) -> int:
    """Refuse a message over the server's ``max_payload`` before it is sent.

    ``data`` is the encoded body (or its length). The server counts headers too, so
    they are included. Returns the total size; raises :class:`PayloadTooLarge`.
    """
    body = data if isinstance(data, int) else len(data)
    hbytes = header_size(hdrs)
    total = body + hbytes
    if max_payload > 0 and total > max_payload:
        raise PayloadTooLarge(total, max_payload, subject, hbytes)
    return total
