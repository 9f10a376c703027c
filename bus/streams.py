"""The two JetStream work queues (generate, prefill) and their shared pull consumers.

Why work queues: a message is stored until exactly one worker acknowledges it, workers
*pull* only when they have room (batch slot, KV blocks), and the pending count is what
KEDA scales on — scale from zero included.

Each stream captures exactly its pool subject (``tandem.<model>.generate``), never the
targeted ``tandem.<model>.generate.<worker>`` subjects, which stay core request–reply.

:func:`ensure_streams` is idempotent and safe to call from every process at start:
missing streams/consumers are created, matching ones left alone, differing ones
updated; a change the server refuses (e.g. retention) raises :class:`StreamConfigError`
naming the stream, the differences and the server's reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from bus.control_messages import Claim
from bus.subjects import Subjects
from bus.wire import encode, headers

log = logging.getLogger("tandem.bus.streams")

Pool = Literal["generate", "prefill"]


class StreamConfigError(RuntimeError):
    """A stream or consumer exists with a configuration that could not be brought in line."""


@dataclass(frozen=True)
class WorkQueueConfig:
    """Limits of one work queue. Times in seconds.

    ``max_age`` drops requests nobody pulled in time (their deadline has passed anyway);
    ``ack_wait`` is how long a pulled, un-acked message stays invisible before it is
    redelivered (workers ack when they admit a message, or call ``in_progress()``);
    ``max_deliver`` bounds redeliveries of a message that keeps failing;
    ``duplicate_window`` de-duplicates publishes with the same ``Nats-Msg-Id``;
    ``max_msgs`` (-1 = unbounded) with discard ``new`` makes a full queue refuse
    publishes (back-pressure the gateway sees) instead of silently dropping old work.
    """

    max_age: float = 300.0
    ack_wait: float = 30.0
    max_deliver: int = 3
    duplicate_window: float = 60.0
    max_msgs: int = -1
    max_bytes: int = -1
    storage: str = "file"
    replicas: int = 1
    max_ack_pending: int = 10_000
    max_waiting: int = 512

    def __post_init__(self) -> None:
        if self.duplicate_window > self.max_age:
            raise ValueError("duplicate_window must not exceed max_age")
        if self.max_deliver < 1 and self.max_deliver != -1:
            raise ValueError("max_deliver must be >= 1 (or -1 for unlimited)")


#: A full generate queue refuses new requests (the gateway answers 429) rather than growing without bound.
DEFAULT_GENERATE = WorkQueueConfig(max_age=300.0, ack_wait=30.0, max_deliver=3, max_msgs=10_000)
DEFAULT_PREFILL = WorkQueueConfig(max_age=120.0, ack_wait=30.0, max_deliver=3)


def stream_config(name: str, subject: str, cfg: WorkQueueConfig, description: str = "") -> api.StreamConfig:
    """The JetStream stream config of one work queue (exactly one subject)."""
    return api.StreamConfig(
        name=name,
        description=description or None,
        subjects=[subject],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType(cfg.storage),
        num_replicas=cfg.replicas,
        max_age=cfg.max_age,
        max_msgs=cfg.max_msgs,
        max_bytes=cfg.max_bytes,
        discard=api.DiscardPolicy.NEW,
        duplicate_window=cfg.duplicate_window,
    )


def consumer_config(
    durable: str, subject: str, cfg: WorkQueueConfig, description: str = ""
) -> api.ConsumerConfig:
    """The durable pull consumer shared by all workers of one pool."""
    return api.ConsumerConfig(
        name=durable,
        durable_name=durable,
        description=description or None,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=cfg.ack_wait,
        max_deliver=cfg.max_deliver,
        filter_subject=subject,
        max_ack_pending=cfg.max_ack_pending,
        max_waiting=cfg.max_waiting,
    )


_STREAM_FIELDS = (
    "subjects",
    "retention",
    "storage",
    "num_replicas",
    "max_age",
    "max_msgs",
    "max_bytes",
    "discard",
    "duplicate_window",
)
_CONSUMER_FIELDS = (
    "deliver_policy",
    "ack_policy",
    "ack_wait",
    "max_deliver",
    "filter_subject",
    "max_ack_pending",
    "max_waiting",
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return (
            a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)
        )
    return a == b


def _diff(want: Any, have: Any, fields: tuple[str, ...]) -> dict[str, tuple[Any, Any]]:
    out = {}
    for f in fields:
        w, h = getattr(want, f), getattr(have, f)
        if w is None:
            continue
        if not _same(w, h):
            out[f] = (h, w)
    return out


def _fmt(diff: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in diff.items())


async def ensure_stream(js: JetStreamContext, config: api.StreamConfig) -> tuple[api.StreamInfo, str]:
    """Create the stream, or update it to ``config``. Returns (info, "created"|"unchanged"|"updated")."""
    assert config.name is not None
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        try:
            info = await js.add_stream(config)
        except APIError as e:
            raise StreamConfigError(
                f"cannot create stream {config.name} on {config.subjects}: {e.description}"
            ) from e
        log.info("created stream %s on %s", config.name, config.subjects)
        return info, "created"
    if (info.config.num_replicas or 1) > (config.num_replicas or 1):
        # Replication is an operator's choice (a clustered deploy creates the streams with R3);
        # a worker starting with the default must not shrink it.
        config = dataclasses.replace(config, num_replicas=info.config.num_replicas)
    diff = _diff(config, info.config, _STREAM_FIELDS)
    if not diff:
        return info, "unchanged"
    try:
        info = await js.update_stream(config)
    except APIError as e:
        raise StreamConfigError(
            f"stream {config.name} exists with a different configuration ({_fmt(diff)}) and the server "
            f"refused to update it: {e.description}. Delete it (nats stream rm {config.name}) or align the settings."
        ) from e
    log.warning("updated stream %s: %s", config.name, _fmt(diff))
    return info, "updated"


async def ensure_consumer(
    js: JetStreamContext, stream: str, config: api.ConsumerConfig
) -> tuple[api.ConsumerInfo, str]:
    """Create the durable consumer, or update it. Returns (info, "created"|"unchanged"|"updated")."""
    assert config.durable_name is not None
    try:
        info: api.ConsumerInfo | None = await js.consumer_info(stream, config.durable_name)
    except NotFoundError:
        info = None
    diff: dict[str, tuple[Any, Any]] = {}
    if info is not None:
        diff = _diff(config, info.config, _CONSUMER_FIELDS)
        if not diff:
            return info, "unchanged"
    try:
        new_info = await js.add_consumer(stream, config)
    except APIError as e:
        what = f" (differences: {_fmt(diff)})" if info is not None else ""
        raise StreamConfigError(
            f"cannot {'update' if info is not None else 'create'} consumer {config.durable_name} on stream "
            f"{stream}{what}: {e.description}"
        ) from e
    if info is None:
        log.info("created consumer %s on %s", config.durable_name, stream)
        return new_info, "created"
    log.warning("updated consumer %s on %s: %s", config.durable_name, stream, _fmt(diff))
    return new_info, "updated"


@dataclass(frozen=True)
class EnsureResult:
    """What :func:`ensure_streams` did to each object (``created``/``unchanged``/``updated``)."""

    generate_stream: str
    generate_consumer: str
    prefill_stream: str
    prefill_consumer: str
    claims_stream: str


#: how long a claim on a request (or prefill job) is remembered: a copy delivered later is served again
CLAIM_WINDOW_S = 600.0


def claims_config(subjects: Subjects, replicas: int = 1) -> api.StreamConfig:
    """The claims stream: its duplicate window (``Nats-Msg-Id`` = the work's key) answers "who was first"."""
    return api.StreamConfig(
        name=subjects.claims_stream,
        description=f"tandem claims for model {subjects.model}: each request is served by one worker",
        subjects=[subjects.claims],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        num_replicas=replicas,
        max_age=CLAIM_WINDOW_S,
        discard=api.DiscardPolicy.OLD,
        duplicate_window=CLAIM_WINDOW_S,
    )


def claim_key(kind: type, key: str) -> str:
    """What a worker claims to serve work ``key`` of type ``kind`` (a decode worker that withdraws its prefill
    job from the pool claims the same key, so a prefill worker holding a copy drops it)."""
    return f"{kind.__name__}:{key}"


#: JetStream's "message delete failed" (a sequence no longer in the stream: a work-queue message taken and acked)
MSG_DELETE_FAILED = 10057


def taken_already(e: APIError) -> bool:
    """Whether deleting a work-queue message failed because it is no longer there (a worker took it)."""
    return isinstance(e, NotFoundError) or e.err_code == MSG_DELETE_FAILED


async def claim(nc_or_js: Client | JetStreamContext, subjects: Subjects, key: str, owner: str,
                request_id: str = "", timeout: float = 5.0) -> bool:
    """True when ``owner`` is the first to claim ``key`` (within :data:`CLAIM_WINDOW_S`), False for a copy.

    Why here: copies of one request (``nats pub`` twice, a publisher's retry without ``Nats-Msg-Id``)
    can reach different workers, whose own memories of what they served never meet. The stream's
    duplicate window is the one place they do. Raises on a NATS or JetStream failure (the caller
    decides whether to serve unclaimed).
    """
    body = encode(Claim(key=key, request_id=request_id, worker_id=owner))
    ack = await _js(nc_or_js, timeout).publish(subjects.claims, body, timeout=timeout,
                                              headers=headers(request_id or None, key))
    return not ack.duplicate


def _js(nc_or_js: Client | JetStreamContext, timeout: float) -> JetStreamContext:
    return nc_or_js if isinstance(nc_or_js, JetStreamContext) else nc_or_js.jetstream(timeout=timeout)


async def ensure_streams(
    nc_or_js: Client | JetStreamContext,
    subjects: Subjects,
    generate: WorkQueueConfig = DEFAULT_GENERATE,
    prefill: WorkQueueConfig = DEFAULT_PREFILL,
    *,
    replicas: int | None = None,
    timeout: float = 5.0,
    cluster_wait: float = 60.0,
) -> EnsureResult:
    """Make sure both work-queue streams and their durable pull consumers exist as configured
    (``replicas``, when given, for all three streams: ``TANDEM_STREAM_REPLICAS``).

    With more than one replica the servers are a cluster, which may still be forming when a process
    starts (no JetStream leader yet, too few members to place the replicas): the attempt is repeated
    for up to ``cluster_wait`` seconds before its error is raised.
    """
    if replicas is not None:
        generate, prefill = dataclasses.replace(generate, replicas=replicas), dataclasses.replace(prefill, replicas=replicas)
    deadline = time.monotonic() + (cluster_wait if max(generate.replicas, prefill.replicas) > 1 else 0.0)
    while True:
        try:
            return await _ensure_streams_once(nc_or_js, subjects, generate, prefill, timeout)
        except (StreamConfigError, NatsTimeoutError, asyncio.TimeoutError) as e:
            if time.monotonic() >= deadline:
                raise
            log.info("the JetStream cluster is not ready for the streams yet (%s); trying again", e)
            await asyncio.sleep(1.0)


async def _ensure_streams_once(nc_or_js: Client | JetStreamContext, subjects: Subjects, generate: WorkQueueConfig,
                               prefill: WorkQueueConfig, timeout: float) -> EnsureResult:
    js = _js(nc_or_js, timeout)
    try:
        await js.account_info()
    except (NoRespondersError, ServiceUnavailableError) as e:
        raise StreamConfigError(
            "JetStream is not enabled on this NATS server (start nats-server with -js, "
            "or enable jetstream for this account)"
        ) from e
    except APIError as e:
        raise StreamConfigError(f"JetStream refused this account: {e.description}") from e
    results: list[str] = []
    for stream, consumer, subject, cfg, what in (
        (subjects.generate_stream, subjects.generate_consumer, subjects.generate_pool, generate, "generate"),
        (subjects.prefill_stream, subjects.prefill_consumer, subjects.prefill_pool, prefill, "prefill"),
    ):
        desc = f"tandem {what} pool for model {subjects.model}"
        _, s_state = await ensure_stream(js, stream_config(stream, subject, cfg, desc))
        _, c_state = await ensure_consumer(js, stream, consumer_config(consumer, subject, cfg, desc))
        results += [s_state, c_state]
    _, claims_state = await ensure_stream(js, claims_config(subjects, generate.replicas))
    return EnsureResult(*results, claims_state)


def pool_names(subjects: Subjects, pool: Pool) -> tuple[str, str, str]:
    """(stream, consumer, subject) of a pool."""
    if pool == "generate":
        return subjects.generate_stream, subjects.generate_consumer, subjects.generate_pool
    if pool == "prefill":
        return subjects.prefill_stream, subjects.prefill_consumer, subjects.prefill_pool
    raise ValueError(f"unknown pool {pool!r}: expected 'generate' or 'prefill'")


async def pull_subscription(
    nc_or_js: Client | JetStreamContext, subjects: Subjects, pool: Pool, *, timeout: float = 5.0
) -> JetStreamContext.PullSubscription:
    """Bind to a pool's shared durable consumer (the streams must exist: :func:`ensure_streams`)."""
    stream, consumer, _ = pool_names(subjects, pool)
    return await _js(nc_or_js, timeout).pull_subscribe_bind(consumer=consumer, stream=stream)


async def fetch_one(psub: JetStreamContext.PullSubscription, timeout: float) -> Msg | None:
    """Pull at most one message, waiting up to ``timeout`` s; None when the queue stayed empty.

    Call it only when the worker can take the job (pull-based admission); ack the
    message once admitted (``await msg.ack()``), ``nak()`` to hand it back.
    """
    try:
        msgs = await psub.fetch(1, timeout=timeout)
    except (NatsTimeoutError, asyncio.TimeoutError):
        return None
    return msgs[0] if msgs else None


async def pool_backlog(
    nc_or_js: Client | JetStreamContext, subjects: Subjects, pool: Pool, *, timeout: float = 2.0
) -> tuple[int, int]:
    """(pending, in flight) of a pool: messages not yet pulled, and pulled but not acked."""
    stream, consumer, _ = pool_names(subjects, pool)
    info = await _js(nc_or_js, timeout).consumer_info(stream, consumer, timeout=timeout)
    return int(info.num_pending or 0), int(info.num_ack_pending or 0)
