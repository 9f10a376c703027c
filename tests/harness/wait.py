"""The one way a test waits for something to become true (no test rolls its own deadline loop)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str | Callable[[], str],
               interval: float = 0.05, ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something true, and return that.

    After ``timeout`` seconds an AssertionError names ``what`` (a callable is asked only then, e.g. for a
    log tail worth showing) and the last value seen, so a failed wait says what it waited for and how far
    it got. An exception of a type in ``ignore`` counts as "not yet" (a server still starting); any other
    one, an assertion of the predicate's own included, fails at once. From async code:
    ``await asyncio.to_thread(wait_until, ...)`` (the event loop keeps running meanwhile).
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
        except ignore as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            name = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:g}s waiting for {name}; last seen: {last!r}")
        time.sleep(interval)
