"""Sending tandem messages: encode, attach the request-id header, refuse oversize, send.

Why: NATS drops a connection (or nats-py raises a bare ``MaxPayloadError``) when a
message is over the server's ``max_payload``; the caller would see a hang or a vague
error. These helpers check the size against the connected server's limit first and
raise :class:`~bus.wire.PayloadTooLarge` naming the size and the limit.
"""

from __future__ import annotations

from typing import Any

import msgspec
from nats.aio.client import Client
from nats.js.api import PubAck
from nats.js.client import JetStreamContext
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

from bus.replay import SentLog
from bus.wire import check_payload, decode, encode, headers


def _prepare(
    nc: Client,
    subject: str,
    msg: msgspec.Struct,
    request_id: str | None,
    extra: dict[str, str] | None,
    msg_id: str | None = None,
) -> tuple[bytes, dict[str, str]]:
    rid = request_id if request_id is not None else getattr(msg, "request_id", None)
    hdrs = headers(rid, msg_id)
    if extra:
        hdrs.update(extra)
    data = encode(msg)
    check_payload(data, nc.max_payload, subject, hdrs)
    return data, hdrs


async def publish(
    nc: Client,
    subject: str,
    msg: msgspec.Struct,
    *,
    request_id: str | None = None,
    reply: str = "",
    extra_headers: dict[str, str] | None = None,
) -> None:
    """Core-publish a message (request id header from ``msg.request_id`` unless given)."""
    data, hdrs = _prepare(nc, subject, msg, request_id, extra_headers)
    await nc.publish(subject, data, reply=reply, headers=hdrs or None)


async def publish_kept(nc: Client, sent: SentLog, key: str, seq: int, subject: str, msg: msgspec.Struct, *,
                       end: bool = False) -> None:
    """Core-publish ``msg`` and keep it in ``sent`` under ``key`` (``seq``: its place there; ``end``: the key's
    last message), for a receiver that missed it and asks again (:mod:`bus.replay`). It is kept even when the
    publish fails: the connection is down, and the receiver will ask once it is back."""
    data, hdrs = _prepare(nc, subject, msg, None, None)
    sent.record(key, subject, seq, data, hdrs or None, end=end)
    await nc.publish(subject, data, headers=hdrs or None)


async def request(
    nc: Client,
    subject: str,
    msg: msgspec.Struct,
    reply_type: Any,
    *,
    timeout: float,
    request_id: str | None = None,
    extra_headers: dict[str, str] | None = None,
) -> Any:
    """Core request–reply: send ``msg``, wait up to ``timeout`` s, decode the reply as ``reply_type``.

    Raises ``nats.errors.NoRespondersError`` when nobody listens (e.g. an unknown
    worker), ``nats.errors.TimeoutError`` after ``timeout``, and `ServiceError` when a
    micro endpoint answered with an error.
    """
    data, hdrs = _prepare(nc, subject, msg, request_id, extra_headers)
    resp = await nc.request(subject, data, timeout=timeout, headers=hdrs or None)
    code = (resp.headers or {}).get(ERROR_CODE_HEADER)
    if code:
        raise ServiceError(subject, code, resp.headers.get(ERROR_HEADER, ""))
    return decode(resp.data, reply_type)


class ServiceError(RuntimeError):
    """A micro endpoint's error answer to a request: its code and description."""

    def __init__(self, subject: str, code: str, description: str) -> None:
        super().__init__(f"{subject} answered {code}: {description}")
        self.code, self.description = code, description


async def js_publish(
    nc: Client,
    subject: str,
    msg: msgspec.Struct,
    *,
    js: JetStreamContext | None = None,
    msg_id: str | None = None,
    request_id: str | None = None,
    timeout: float = 5.0,
    extra_headers: dict[str, str] | None = None,
) -> PubAck:
    """Publish to a JetStream subject (a pool) and wait for the stored ack.

    ``msg_id`` sets ``Nats-Msg-Id`` so a retried publish within the stream's duplicate
    window is stored once (use e.g. ``f"{request_id}:{attempt}"``).
    """
    data, hdrs = _prepare(nc, subject, msg, request_id, extra_headers, msg_id)
    ctx = js or nc.jetstream()
    return await ctx.publish(subject, data, timeout=timeout, headers=hdrs or None)
