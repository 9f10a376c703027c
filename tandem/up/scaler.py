"""The local scaler of ``tandem up --autoscale``: starts and drains workers of the plan's slots."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from typing import Any

from bus.options import BusOptions
from bus.subjects import Subjects
from runtime.metrics import AutoscaleMetrics
from runtime.processes import ChildProcess, describe_exit
from tandem.up import UpError
from tandem.up.autoscale import (
    SCALED_ROLE,
    Decider,
    DemandFeed,
    describe,
    plan_actions,
    state_message,
)
from tandem.up.cluster import Cluster, Member
from tandem.up.plan import Plan


class Scaler:
    """The local scaler of ``tandem up --autoscale``: reads demand (:class:`~tandem.up.autoscale.DemandFeed`),
    decides (:class:`~tandem.up.autoscale.Decider`) and starts or drains workers of the plan's slots."""

    def __init__(self, cluster: Cluster, plan: Plan, make_child: Callable[[str, str, int], ChildProcess],
                 bus: BusOptions, cooldown: float, interval: float) -> None:
        assert plan.autoscale is not None
        self.cluster = cluster
        self.plan = plan
        self.make_child = make_child
        self.policies = plan.autoscale
        self.decider = Decider(self.policies, cooldown)
        self.feed = DemandFeed(bus, Subjects(plan.model_name, plan.namespace), interval)
        self.interval = interval
        self.metrics = AutoscaleMetrics()
        self.draining: dict[str, float] = {}  # worker id -> when to SIGKILL it
        self.last_action: dict[str, str] = {}
        self.next_check = 0.0
        self.stale_said = False
        self.started_at = 0.0
        self._server: Any = None

    def start(self) -> None:
        """Connect the feed and serve ``/metrics`` (raises UpError when either cannot)."""
        from prometheus_client import start_http_server

        self.started_at = time.monotonic()
        try:
            self.feed.start()
        except RuntimeError as e:
            raise UpError(str(e)) from e
        port = self.plan.autoscale_metrics_port
        try:
            try:
                self._server, _ = start_http_server(port or 0, addr=self.plan.host, registry=self.metrics.registry)
            except OSError as e:  # a port we picked, taken since: any free one
                if not (self.plan.autoscale_port_picked and e.errno == errno.EADDRINUSE):
                    raise
                self._server, _ = start_http_server(0, addr=self.plan.host, registry=self.metrics.registry)
                self.plan.autoscale_metrics_port = int(self._server.server_address[1])
        except OSError as e:
            self.feed.stop()
            raise UpError(f"--autoscale-metrics-port {port}: {e}") from e

    def close(self) -> None:
        """Stop the feed and the metrics server."""
        self.feed.stop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def next_due(self) -> float:
        """When :meth:`step` has work next: the next reading of the demand or a draining worker's deadline."""
        return min([self.next_check, *self.draining.values()])

    def _members(self, role: str) -> list[Member]:
        """Members of a scaled role that count: not draining, not retired by their supervisor."""
        sup = self.cluster.supervisor
        return [m for m in self.cluster.members if SCALED_ROLE.get(m.role) == role and m.name not in self.draining
                and (sup is None or m.name in sup.watches and not sup.watches[m.name].retired)]

    def step(self, now: float) -> None:
        """One supervision tick: reap drained workers; every ``interval`` seconds, decide and act."""
        self._reap(now)
        if now < self.next_check:
            return
        self.next_check = now + self.interval
        demand, measured = self.feed.demand()
        if not measured or now - measured > max(5.0, 3 * self.interval):
            if not self.stale_said and now - self.started_at > max(5.0, 3 * self.interval):
                self.cluster.warn("tandem up: autoscale: no fresh demand reading; holding the worker counts")
                self.stale_said = True
            return
        self.stale_said = False
        members = {role: self._members(role) for role in self.policies}
        for role, ms in members.items():
            if any(not m.child.is_ready for m in ms):  # the cool-down runs from when the new workers serve
                self.decider.did_change(role, now)
        actions = plan_actions(self.decider, demand, {r: len(ms) for r, ms in members.items()}, now)
        for a in actions:
            policy = self.policies[a.role]
            if a.target > a.actual:
                free = self._free_slots(a.role)[:a.target - a.actual]  # a draining worker holds its slot
                if free:
                    a.target = a.actual + len(free)
                    self._decided(a, "up", describe(a, policy, "starting", [self._start(slot) for slot in free]), now)
                else:
                    a.target = a.actual
            elif a.target < a.actual:
                victims = self._victims(members[a.role], a.actual - a.target)
                for m in victims:
                    self._drain(m, now)
                self._decided(a, "down", describe(a, policy, "draining", [m.name for m in victims]), now)
            m = self.metrics
            m.demand.labels(a.role).set(a.demand.total)
            m.desired.labels(a.role).set(a.desired)
            m.workers.labels(a.role).set(a.target)
            m.draining.labels(a.role).set(sum(1 for w in self.draining if self._role_of(w) == a.role))
        counts = {a.role: sum(1 for w in self.draining if self._role_of(w) == a.role) for a in actions}
        for a in actions:
            a.actual = a.target
        self.feed.state = state_message(f"tandem-up-{os.getpid()}", self.plan.model_name, actions, self.policies,
                                        counts, self.last_action)

    def _role_of(self, worker_id: str) -> str:
        return next(SCALED_ROLE[r] for w, r, _ in self.plan.slots if w == worker_id)

    def _decided(self, a: Any, action: str, line: str, now: float) -> None:
        self.cluster.say(f"tandem up: {line}")
        self.metrics.decisions.labels(a.role, action).inc()
        self.last_action[a.role] = f"{action} to {a.target} at {time.strftime('%H:%M:%S')}"
        self.decider.did_change(a.role, now)

    def _free_slots(self, role: str) -> list[tuple[str, str, int]]:
        taken = {m.name for m in self.cluster.members}
        return [slot for slot in self.plan.slots if SCALED_ROLE[slot[1]] == role and slot[0] not in taken]

    def _start(self, slot: tuple[str, str, int]) -> str:
        wid, prole, port = slot
        child = self.make_child(wid, prole, port)
        self.cluster.add(child, prole, port)
        child.start()
        assert self.cluster.supervisor is not None
        self.cluster.supervisor.add(child)
        return wid

    def _victims(self, members: list[Member], n: int) -> list[Member]:
        """The ``n`` least loaded (by their last reports), the newest first among equals."""
        order = {w: i for i, (w, _, _) in enumerate(self.plan.slots)}
        return sorted(members, key=lambda m: (self.feed.load(m.name), -order[m.name]))[:n]

    def _drain(self, m: Member, now: float) -> None:
        assert self.cluster.supervisor is not None
        self.cluster.supervisor.remove(m.name)  # its exit is on purpose, not a failure to restart
        m.child.terminate()
        self.draining[m.name] = now + self.cluster.drain_timeout + self.cluster.stop_timeout

    def _reap(self, now: float) -> None:
        sup = self.cluster.supervisor
        for m in list(self.cluster.members):
            if sup is not None and m.name in sup.watches and sup.watches[m.name].retired:
                sup.remove(m.name)  # exited by itself (drained from outside): its slot is free again
                self.cluster.members.remove(m)
        for name, kill_at in list(self.draining.items()):
            m = next(x for x in self.cluster.members if x.name == name)
            code = m.child.poll()
            if code is None and now > kill_at:
                self.cluster.warn(f"tandem up: autoscale: {name} did not finish draining in time; killing it")
                m.child.kill()
                code = m.child.poll()
            if code is not None:
                self.cluster.say(f"tandem up: autoscale: {name} drained and stopped ({describe_exit(code)})")
                self.cluster.members.remove(m)
                del self.draining[name]
