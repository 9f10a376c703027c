"""The one way a test waits for something to become true (no test rolls its own deadline loop)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class _NotYet:
    """An exception of a type the wait ignores, as its last value: false, and shown as the exception."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return repr(self.error)


class _Deadline:
    """How long a wait may still go on, and the error that says what it waited for once it may not."""

    def __init__(self, timeout: float, what: str | Callable[[], str]) -> None:
        self.timeout, self.what, self.at = timeout, what, time.monotonic() + timeout

    def settled(self, last: Any) -> bool:
        """Whether ``last`` ends the wait (it is true); raises once the time is up without it."""
        if last:
            return True
        if time.monotonic() >= self.at:
            name = self.what() if callable(self.what) else self.what
            raise AssertionError(f"timed out after {self.timeout:g}s waiting for {name}; last seen: {last!r}")
        return False


def wait_until(predicate: Callable[[], T], timeout: float, what: str | Callable[[], str],
               interval: float = 0.05, ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something true, and return that.

    After ``timeout`` seconds an AssertionError names ``what`` (a callable is asked only then, e.g. for a
    log tail worth showing) and the last value seen, so a failed wait says what it waited for and how far
    it got. An exception of a type in ``ignore`` counts as "not yet" (a server still starting); any other
    one, an assertion of the predicate's own included, fails at once. From async code: `until`, or for a
    predicate that blocks (a plain HTTP call), ``await asyncio.to_thread(wait_until, ...)``.
    """
    deadline = _Deadline(timeout, what)
    while True:
        try:
            last: Any = predicate()
        except ignore as e:
            last = _NotYet(e)
        if deadline.settled(last):
            return last
        time.sleep(interval)


async def until(predicate: Callable[[], T | Awaitable[T]], timeout: float, what: str | Callable[[], str],
                interval: float = 0.05, ignore: tuple[type[BaseException], ...] = ()) -> T:
    """`wait_until` on the running event loop: ``predicate`` may be a coroutine function, and the loop runs
    between tries (a NATS client reconnects meanwhile)."""
    deadline = _Deadline(timeout, what)
    while True:
        try:
            last: Any = predicate()
            last = await last if inspect.isawaitable(last) else last
        except ignore as e:
            last = _NotYet(e)
        if deadline.settled(last):
            return last
        await asyncio.sleep(interval)


class _Subscription(Protocol):
    async def next_msg(self, timeout: float = ...) -> Any: ...


async def read_until(sub: _Subscription, done: Callable[[list[Any]], bool], timeout: float, what: str,
                     parse: Callable[[bytes], Any] = json.loads) -> list[Any]:
    """The messages of NATS subscription ``sub``, each ``parse``d, from now until ``done(messages so far)``; an
    AssertionError naming ``what`` and showing what came, if ``timeout`` seconds pass first."""
    got: list[Any] = []
    deadline = _Deadline(timeout, lambda: f"{what} ({len(got)} messages came, the last {got[-1:]!r})")
    while not deadline.settled(done(got)):
        with contextlib.suppress(TimeoutError):  # nats' timeout is one; the deadline says when to stop
            got.append(parse((await sub.next_msg(timeout=max(0.01, deadline.at - time.monotonic()))).data))
    return got


async def read_quiet(sub: _Subscription, quiet: float, parse: Callable[[bytes], Any] = json.loads) -> list[Any]:
    """The messages of ``sub``, each ``parse``d, until none comes for ``quiet`` seconds: time itself is what is
    under test (that nothing more comes)."""
    got: list[Any] = []
    with contextlib.suppress(TimeoutError):
        while True:
            got.append(parse((await sub.next_msg(timeout=quiet)).data))
    return got
