"""The demand signal of each role: what an autoscaler (KEDA, ``tandem up --autoscale``) sizes workers on.

Why one definition: KEDA's ``nats-jetstream`` scaler sees only a pool's lag, but the gateway sends
most requests straight to a decode worker (``gateway/router.py``) until every worker is at
``max_batch``, and a decode worker prefills locally while no prefill worker is alive. Lag alone
therefore rises only once every decode worker is saturated, and never wakes a prefill role scaled
to zero. Demand adds what the pools do not see::

    lag(pool)      = num_pending + num_ack_pending of the pool's durable consumer
                     (what KEDA reads from /jsz; here from the JetStream API: the same numbers)
    decode demand  = lag(generate) + sum over decode workers of the requests each holds
                     (routed to it or pulled, prefilling, decoding or waiting: its ``running``)
    prefill demand = lag(prefill) + sum over prefill workers of running + queued jobs
                     (targeted jobs wait in a worker's backlog, not in the pool)
                     + sum over decode_only workers of ``deferred_prefills``: prompts prefilled
                     locally only because no prefill worker was alive or free, not yet done

The gateway exports both as ``tandem_demand{role}`` (KEDA's Prometheus trigger reads it) and the
local scaler of ``tandem up`` computes them the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bus.stats_messages import WorkerStats
from bus.streams import pool_backlog, pool_names
from bus.subjects import Subjects
from runtime.names import ROLE_DECODE_ONLY, ROLE_PREFILL_AND_DECODE, ROLE_PREFILL_ONLY

#: The two roles an autoscaler sizes (``decode`` covers ``prefill_and_decode`` workers too).
SCALED_ROLES = ("prefill", "decode")
#: Local-prefill reasons that a prefill worker would have taken (``actors/decode.py`` decisions).
DEFERRED_REASONS = frozenset({"no_prefill_worker", "prefill_backlog"})


@dataclass(frozen=True)
class Demand:
    """One role's demand and its parts (for logs, ``tandem status`` and the benchmark)."""

    role: str
    lag: int  # pending + unacknowledged in the role's pool
    held: int  # what the role's workers (and, for prefill, decode workers standing in) hold

    @property
    def total(self) -> int:
        """The signal: lag + held."""
        return self.lag + self.held


def pool_of(role: str) -> str:
    """The JetStream pool of a scaled role."""
    if role not in SCALED_ROLES:
        raise ValueError(f"unknown role {role!r}: expected one of {SCALED_ROLES}")
    return "generate" if role == "decode" else "prefill"


def held_by(role: str, stats: WorkerStats) -> int:
    """The part of ``role``'s demand that one worker's report carries (0 when it carries none)."""
    if role == "decode" and stats.role in (ROLE_DECODE_ONLY, ROLE_PREFILL_AND_DECODE):
        return stats.running  # a decode worker's running counts every request it holds; queued is part of it
    if role == "prefill" and stats.role == ROLE_PREFILL_ONLY:
        return stats.running + stats.queued
    if role == "prefill" and stats.role == ROLE_DECODE_ONLY:
        return stats.deferred_prefills
    return 0


def role_demand(role: str, lag: int, stats: Iterable[WorkerStats]) -> Demand:
    """``role``'s demand from its pool's lag and the latest report of every live worker."""
    pool_of(role)  # a known role
    return Demand(role, lag, sum(held_by(role, s) for s in stats))


async def pool_lag(nc: Any, subjects: Subjects, role: str, timeout: float = 2.0) -> int:
    """Lag of ``role``'s pool through the JetStream API (consumer info): pending + unacknowledged."""
    pending, in_flight = await pool_backlog(nc, subjects, pool_of(role), timeout=timeout)
    return pending + in_flight


async def demands(nc: Any, subjects: Subjects, stats: Iterable[WorkerStats], timeout: float = 2.0) -> dict[str, Demand]:
    """Both roles' demand now (two consumer-info requests)."""
    reports = list(stats)
    return {role: role_demand(role, await pool_lag(nc, subjects, role, timeout), reports) for role in SCALED_ROLES}


def lag_from_jsz(jsz: dict[str, Any], stream: str, consumer: str, account: str | None = None) -> int | None:
    """A consumer's lag as KEDA's ``nats-jetstream`` scaler reads it from ``/jsz?consumers=true``.

    ``num_pending + num_ack_pending`` of the named consumer (in ``account`` when given); None when
    the server does not list it (KEDA then reports no metric).
    """
    for acc in jsz.get("account_details") or []:
        if account is not None and acc.get("name") != account:
            continue
        for st in acc.get("stream_detail") or []:
            if st.get("name") != stream:
                continue
            for c in st.get("consumer_detail") or []:
                if c.get("name") == consumer:
                    return int(c.get("num_pending") or 0) + int(c.get("num_ack_pending") or 0)
    return None


def jsz_lag(jsz: dict[str, Any], subjects: Subjects, role: str, account: str | None = None) -> int | None:
    """:func:`lag_from_jsz` for ``role``'s pool."""
    stream, consumer, _ = pool_names(subjects, pool_of(role))
    return lag_from_jsz(jsz, stream, consumer, account)
