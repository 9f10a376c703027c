"""Supervision of child processes: restart the ones that die, with backoff; give up on one that cannot run.

:class:`Supervisor` watches a set of :class:`Supervised` units (a
:class:`~runtime.processes.ChildProcess`, or the embedded NATS) and restarts one that dies, with
exponential backoff and a cap; it gives up, naming the unit and why, when a unit keeps dying at start-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from runtime.processes import describe_exit


class Supervised(Protocol):
    """A unit :class:`Supervisor` can watch and restart."""

    name: str

    @property
    def pid(self) -> int | None: ...

    @property
    def is_ready(self) -> bool: ...

    def start(self) -> object: ...

    def poll(self) -> int | None: ...

    def last_lines(self, n: int = 20) -> str: ...


#: exit status of a tandem process refusing its configuration: restarting it cannot help
EXIT_BAD_CONFIG = 2


@dataclass(frozen=True)
class RestartPolicy:
    """When and how fast a dead unit is started again.

    ``mode`` ``on-failure`` restarts a unit that exits by itself with a non-zero status or a
    signal; ``never`` restarts nothing. The wait before restart ``k`` (1-based, counting failures
    since the unit last ran ``stable_after`` seconds) is ``delay`` × 2^(k-1), at most ``max_delay``.
    A unit that dies before it was ever ready ``max_start_failures`` times in a row, or once with
    exit status 2 (a configuration it refuses), is given up on.
    """

    mode: str = "on-failure"
    delay: float = 1.0
    max_delay: float = 30.0
    max_start_failures: int = 3
    stable_after: float = 30.0

    def __post_init__(self) -> None:
        if self.mode not in ("on-failure", "never"):
            raise ValueError(f"--restart must be on-failure or never, got {self.mode!r}")
        if not 0 < self.delay <= self.max_delay:
            raise ValueError("the restart delay must be positive and at most the maximum delay")
        if self.max_start_failures < 1:
            raise ValueError("max_start_failures must be at least 1")

    def backoff(self, failures: int) -> float:
        """Seconds to wait before the restart that follows ``failures`` recent failures (>= 1)."""
        return min(self.max_delay, self.delay * 2 ** min(max(failures, 1) - 1, 30))


class GiveUp(Exception):
    """The supervisor stopped trying: the message names the unit and why; ``output`` is its last lines."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


@dataclass
class _Watch:
    unit: Supervised
    essential: bool
    restarts: int = 0
    failures: int = 0  # since it last ran stable_after seconds
    start_failures: int = 0  # in a row, before it was ever ready
    restart_at: float | None = None
    ready_since: float | None = None
    last_exit: str = ""
    retired: bool = False  # exited cleanly and was not restarted


@dataclass
class Supervisor:
    """Watch units and restart the ones that die (call :meth:`check` when one may have died or become
    ready, and by :meth:`next_due`).

    ``essential`` units (NATS, the gateway) cannot be done without: one that exits cleanly by
    itself ends the supervision (:class:`GiveUp`); a worker that does is left stopped.
    """

    policy: RestartPolicy
    say: Callable[[str], None]
    #: called with a unit and its new restart count just before it is started again
    before_restart: Callable[[Supervised, int], None] | None = None
    watches: dict[str, _Watch] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic

    def add(self, unit: Supervised, essential: bool = False) -> None:
        """Watch ``unit`` (already started, or about to be)."""
        self.watches[unit.name] = _Watch(unit, essential)

    def restarts(self, name: str) -> int:
        """How many times ``name`` was restarted (0 for a unit no longer watched)."""
        w = self.watches.get(name)
        return w.restarts if w is not None else 0

    def remove(self, name: str) -> None:
        """Stop watching ``name`` (a worker being drained on purpose: its exit is no failure)."""
        self.watches.pop(name, None)

    def next_due(self) -> float | None:
        """When the next planned restart is due (on :attr:`clock`), or None: until then only a death (or a unit
        becoming ready) changes anything, so a caller may sleep until one of those wakes it."""
        due = [w.restart_at for w in self.watches.values() if w.restart_at is not None and not w.retired]
        return min(due) if due else None

    def check(self) -> None:
        """Notice deaths, schedule and perform restarts; raises :class:`GiveUp` to stop everything."""
        now = self.clock()
        for w in self.watches.values():
            if w.retired:
                continue
            if w.restart_at is not None:
                if now >= w.restart_at:
                    self._restart(w)
                continue
            code = w.unit.poll()
            if code is None:
                if w.unit.is_ready:
                    if w.ready_since is None:
                        w.ready_since = now
                        w.start_failures = 0
                    self._forget_failures_if_stable(w, now)
                continue
            self._died(w, code, now)

    def _forget_failures_if_stable(self, w: _Watch, now: float) -> None:
        """A unit that has been ready ``stable_after`` seconds starts its backoff over."""
        if w.ready_since is not None and now - w.ready_since >= self.policy.stable_after:
            w.failures = 0

    def _died(self, w: _Watch, code: int, now: float) -> None:
        unit, p = w.unit, self.policy
        was_ready = w.ready_since is not None or unit.is_ready
        self._forget_failures_if_stable(w, now)  # no check need have come by since it became stable
        w.ready_since = None
        w.last_exit = describe_exit(code)
        stage = "while serving" if was_ready else "during start-up"
        what = f"{unit.name} (pid {unit.pid}) {w.last_exit} {stage}"
        if code == 0:
            if w.essential:
                raise GiveUp(f"{what}: it exited by itself and nothing serves without it", unit.last_lines())
            w.retired = True
            self.say(f"{what}: it exited by itself; not restarting it")
            return
        if p.mode == "never":
            raise GiveUp(f"{what} (--restart never)", unit.last_lines())
        if not was_ready:
            w.start_failures += 1
            if code == EXIT_BAD_CONFIG:
                raise GiveUp(f"{what}: it refused its configuration, so restarting cannot help", unit.last_lines())
            if w.start_failures >= p.max_start_failures:
                raise GiveUp(f"{what}, {w.start_failures} times in a row", unit.last_lines())
        w.failures += 1
        delay = p.backoff(w.failures)
        w.restart_at = now + delay
        self.say(f"{what}; restarting it in {delay:g}s (restart {w.restarts + 1})")

    def _restart(self, w: _Watch) -> None:
        w.restart_at = None
        w.restarts += 1
        if self.before_restart is not None:
            self.before_restart(w.unit, w.restarts)
        try:
            w.unit.start()
        except Exception as e:  # counts as a start-up failure
            w.start_failures += 1
            w.failures += 1
            if w.start_failures >= self.policy.max_start_failures:
                raise GiveUp(f"{w.unit.name} could not be started again, {w.start_failures} times in a row: {e}",
                             w.unit.last_lines()) from e
            delay = self.policy.backoff(w.failures)
            w.restart_at = self.clock() + delay
            self.say(f"{w.unit.name} could not be started again ({e}); trying again in {delay:g}s")
            return
        self.say(f"{w.unit.name} restarted (pid {w.unit.pid}, restart {w.restarts})")
