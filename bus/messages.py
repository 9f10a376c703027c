"""Every message type tandem puts on NATS, in one union: for decoding a message whose kind is not known in
advance (``tandem tail``). The wire format is :mod:`bus.wire`; the messages are in ``bus/*_messages.py``."""

from __future__ import annotations

from typing import Any, Union

from bus.control_messages import Cancel, Claim, Replay
from bus.generate_messages import GenerateRequest, StreamError, StreamFinish, StreamTokens
from bus.prefill_messages import KVMetaReply, KVMetaRequest, PrefillAccepted, PrefillDone, PrefillJob
from bus.stats_messages import AutoscaleState, WorkerStats
from bus.wire import Msg, decode

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
MESSAGE_TYPES: tuple[type[Msg], ...] = AnyMessage.__args__  # type: ignore[attr-defined]


def decode_any(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse any tandem message, dispatching on its ``kind`` tag (for tail / debugging)."""
    return decode(data, AnyMessage)
