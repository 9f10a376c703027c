"""``tandem up --autoscale``: start and drain workers on this host from each role's demand.

The signal is the one :mod:`bus.demand` defines (pool lag from the JetStream API — the numbers
KEDA reads from ``/jsz`` — plus what the workers hold), and the rule is KEDA's: a role whose
minimum is 0 is active only while its demand exceeds its activation threshold; an active role
wants ``ceil(demand / target)`` workers, within its range. Scale-up is immediate; a scale-down
waits until the role has wanted fewer workers for the whole cool-down (the largest want of that
window wins, as the HPA's stabilization window does). A worker scaled down is drained
(SIGTERM: it stops taking work, hands back what has not streamed, finishes the rest within
``--drain-timeout``), so no request fails. Every decision is one line and a metric
(``tandem_autoscale_*``); ``tandem status`` shows desired and actual per role.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from bus.demand import SCALED_ROLES, Demand, pool_lag, role_demand
from bus.options import BusOptions
from bus.stats_messages import AutoscaleState, RoleScale, WorkerStats
from bus.subjects import Subjects, model_token
from bus.wire import decode, encode

log = logging.getLogger("tandem.autoscale")

#: the role ``--autoscale`` sizes each pipeline role under
SCALED_ROLE = {"prefill_only": "prefill", "decode_only": "decode", "prefill_and_decode": "decode"}
DEFAULT_TARGET = {"prefill": 2.0, "decode": 4.0}
DEFAULT_ACTIVATION = {"prefill": 1.0, "decode": 0.0}
DEFAULT_COOLDOWN_S = 30.0
#: a worker's report older than this no longer counts (it is gone, or about to be)
STATS_FRESH_S = 3.0


@dataclass(frozen=True)
class RolePolicy:
    """One role's range, per-worker target and activation threshold."""

    min: int
    max: int
    target: float
    activation: float

    def desired(self, demand: float) -> int:
        """KEDA's count for ``demand``: 0 while inactive with a minimum of 0, else ceil(demand/target) in range."""
        if self.min == 0 and demand <= self.activation:
            return 0
        return max(self.min, 1, min(self.max, math.ceil(demand / self.target)))


def _role_items(text: str, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in SCALED_ROLES or not value:
            raise ValueError(f"{flag} {text!r}: expected role=VALUE for roles {' and '.join(SCALED_ROLES)}, "
                             f"comma-separated (e.g. prefill=0..2,decode=1..2)")
        if name in out:
            raise ValueError(f"{flag} {text!r}: {name} is named twice")
        out[name] = value
    return out


def parse_ranges(text: str, flag: str = "--autoscale") -> dict[str, tuple[int, int]]:
    """``prefill=0..2,decode=1..2`` → ``{"prefill": (0, 2), "decode": (1, 2)}``; ValueError names the flag."""
    out: dict[str, tuple[int, int]] = {}
    for role, value in _role_items(text, flag).items():
        low, sep, high = value.partition("..")
        if not (sep and low.isdigit() and high.isdigit()):
            raise ValueError(f"{flag} {text!r}: {role}={value} is not a range MIN..MAX such as 1..2")
        lo, hi = int(low), int(high)
        if hi < lo or hi < 1:
            raise ValueError(f"{flag} {text!r}: {role}={value}: MAX must be at least MIN and at least 1")
        out[role] = (lo, hi)
    if out.get("decode", (1, 1))[0] < 1:
        raise ValueError(f"{flag} {text!r}: decode needs at least 1 worker (the gateway routes to decode workers; "
                         "only prefill scales to zero)")
    return out


def parse_role_numbers(text: str, flag: str, positive: bool) -> dict[str, float]:
    """``prefill=2,decode=4`` → numbers per role; ValueError names the flag."""
    out: dict[str, float] = {}
    for role, value in _role_items(text, flag).items():
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {role}={value} is not a number") from None
        if not (number > 0 if positive else number >= 0) or math.isinf(number):
            raise ValueError(f"{flag} {text!r}: {role}={value} must be {'positive' if positive else 'at least 0'}")
        out[role] = number
    return out


def policies(ranges: dict[str, tuple[int, int]], targets: dict[str, float],
             activations: dict[str, float]) -> dict[str, RolePolicy]:
    """A policy per role named in ``ranges`` (defaults for targets and activations not given)."""
    return {role: RolePolicy(lo, hi, targets.get(role, DEFAULT_TARGET[role]),
                             activations.get(role, DEFAULT_ACTIVATION[role]))
            for role, (lo, hi) in ranges.items()}


class Decider:
    """When to change a role's count: up at once; down only after a whole cool-down since the last change,
    to the largest count wanted during it (the HPA's stabilization window)."""

    def __init__(self, policies: dict[str, RolePolicy], cooldown: float) -> None:
        self.policies = policies
        self.cooldown = cooldown
        self.history: dict[str, collections.deque[tuple[float, int]]] = {r: collections.deque() for r in policies}
        self.changed: dict[str, float] = {}

    def target(self, role: str, demand: float, actual: int, now: float) -> tuple[int, int]:
        """(KEDA's desired count now, the count to have now)."""
        desired = self.policies[role].desired(demand)
        h = self.history[role]
        h.append((now, desired))
        while h[0][0] < now - self.cooldown:
            h.popleft()
        since = self.changed.setdefault(role, now)
        if desired >= actual:
            return desired, desired
        if now - since < self.cooldown:
            return desired, actual
        return desired, min(actual, max(d for _, d in h))

    def did_change(self, role: str, now: float) -> None:
        """A worker of ``role`` was started or drained: the next scale-down waits a whole cool-down."""
        self.changed[role] = now


class DemandFeed:
    """The scaler's NATS side, on a thread of its own: worker reports in, demand out, state answered.

    It hears ``tandem.stats.>``, asks the JetStream API for each pool's consumer info every
    ``interval`` seconds (the same num_pending + num_ack_pending KEDA reads from ``/jsz``), and
    answers ``tandem.autoscale.state`` with the latest :class:`AutoscaleState`.
    """

    def __init__(self, bus: BusOptions, subjects: Subjects, interval: float = 1.0) -> None:
        self.bus = bus
        self.subjects = subjects
        self.interval = interval
        self.state: AutoscaleState | None = None
        self.error: str = ""
        self._lock = threading.Lock()
        self._demand: dict[str, Demand] = {}
        self._measured_at = 0.0
        self._stats: dict[str, tuple[WorkerStats, float]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="autoscale-feed", daemon=True)
        self._started = threading.Event()

    def start(self, timeout: float = 15.0) -> None:
        """Connect (within ``timeout``); raises RuntimeError naming why it could not."""
        self._thread.start()
        if not self._started.wait(timeout) or self.error:
            self.stop()
            raise RuntimeError(f"autoscaler: cannot reach NATS at {self.bus.display_servers}: "
                               f"{self.error or 'timed out'}")

    def stop(self) -> None:
        """End the thread and its connection."""
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=5.0)

    def demand(self) -> tuple[dict[str, Demand], float]:
        """The latest demand per role and when (monotonic) it was measured (0: never)."""
        with self._lock:
            return dict(self._demand), self._measured_at

    def load(self, worker_id: str) -> int:
        """What ``worker_id`` last reported holding (0 when unknown)."""
        st = self._stats.get(worker_id)
        return st[0].running + st[0].queued if st is not None else 0

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        from bus.connection import connect

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            nc = await connect(dataclasses.replace(self.bus, connect_timeout=10.0), name="tandem-autoscale")
        except Exception as e:  # reported by start()
            self.error = str(e) or type(e).__name__
            self._started.set()
            return
        try:
            await nc.subscribe(self.subjects.stats_all, cb=self._on_stats)
            await nc.subscribe(self.subjects.autoscale_state, cb=self._on_state_request)
            self._started.set()
            while not self._stop.is_set():
                await self._measure(nc)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval)
        finally:
            await nc.close()

    async def _measure(self, nc: Any) -> None:
        now = time.monotonic()
        fresh = [st for st, seen in self._stats.values() if now - seen < STATS_FRESH_S]
        try:
            lags = {role: await pool_lag(nc, self.subjects, role, timeout=2.0) for role in SCALED_ROLES}
        except Exception as e:  # NATS away: keep the last figures, the scaler sees their age
            log.warning("autoscaler: cannot read the pools' lag: %r", e)
            return
        with self._lock:
            self._demand = {role: role_demand(role, lags[role], fresh) for role in SCALED_ROLES}
            self._measured_at = time.monotonic()

    async def _on_stats(self, msg: Any) -> None:
        try:
            st = decode(msg.data, WorkerStats)
        except ValueError:
            return
        if st.model and model_token(st.model) != self.subjects.model_token:  # another model's worker
            return
        self._stats[st.worker_id] = (st, time.monotonic())

    async def _on_state_request(self, msg: Any) -> None:
        if msg.reply and self.state is not None:
            await msg.respond(encode(self.state))


@dataclass
class ScaleAction:
    """What the local scaler wants done for one role now."""

    role: str
    demand: Demand
    desired: int
    actual: int
    target: int


def plan_actions(decider: Decider, demand: dict[str, Demand], actual: dict[str, int], now: float) -> list[ScaleAction]:
    """One :class:`ScaleAction` per scaled role."""
    out = []
    for role in decider.policies:
        d = demand.get(role, Demand(role, 0, 0))
        desired, target = decider.target(role, d.total, actual[role], now)
        out.append(ScaleAction(role, d, desired, actual[role], target))
    return out


def describe(action: ScaleAction, policy: RolePolicy, verb: str, workers: list[str]) -> str:
    """The one log line of a decision."""
    d = action.demand
    return (f"autoscale {action.role} {action.actual} -> {action.target} (demand {d.total} = lag {d.lag} + held "
            f"{d.held}; target {policy.target:g} per worker, activation {policy.activation:g}, range "
            f"{policy.min}..{policy.max}): {verb} {', '.join(workers)}")


def state_message(scaler: str, model: str, actions: list[ScaleAction], pols: dict[str, RolePolicy],
                  draining: dict[str, int], last: dict[str, str]) -> AutoscaleState:
    """What ``tandem status`` is told."""
    return AutoscaleState(scaler=scaler, model=model, roles=[
        RoleScale(role=a.role, demand=a.demand.total, lag=a.demand.lag, desired=a.desired, actual=a.actual,
                  draining=draining.get(a.role, 0), min=pols[a.role].min, max=pols[a.role].max,
                  last_action=last.get(a.role, "")) for a in actions])

