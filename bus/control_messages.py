"""Messages about work already sent: cancel it, claim it (so a copy is dropped), publish it again."""

from __future__ import annotations

from bus.wire import Msg, NonNegInt


class Cancel(Msg, tag="cancel", kw_only=True):
    """Anyone → ``tandem.cancel.<request>``: stop work and free the request's blocks."""

    request_id: str
    reason: str = ""


class Claim(Msg, tag="claim", kw_only=True):
    """Worker → ``tandem.<model>.claim`` (JetStream, ``Nats-Msg-Id`` = ``key``): "I serve this".

    The claims stream stores the first claim of a key; a later one within its duplicate
    window is acknowledged as a duplicate, and that worker drops its copy of the work.
    """

    key: str
    request_id: str = ""
    worker_id: str = ""


class Replay(Msg, tag="replay", kw_only=True):
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
