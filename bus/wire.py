"""The wire format of every bus message: the base classes (``kind`` tag, ``v`` schema version), JSON
encoding and decoding, the NATS headers, and the ``max_payload`` check.

Why JSON: a person with the ``nats`` CLI can read (``nats sub 'tandem.>'``) and drive
(``nats pub``) the system. KV bytes never travel here, so JSON's cost is small.

Each message carries

* ``kind``: a tag naming the message type (``"generate_request"``, ``"stream_tokens"`` …),
  so one subscriber can tell apart the messages of one subject (:func:`bus.messages.decode_any`);
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

from typing import Annotated, Any

import msgspec

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


class Msg(msgspec.Struct, kw_only=True, tag_field="kind"):
    """Base of every bus message: ``kind`` tag + ``v`` schema version."""

    v: int = SCHEMA_VERSION


class Part(msgspec.Struct, kw_only=True):
    """Base of nested (untagged) parts of a message."""


NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
#: One (token id, logprob) pair, JSON ``[id, logprob]``.
TopLogprob = tuple[int, float]


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
