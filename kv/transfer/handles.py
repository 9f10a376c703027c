"""A write in flight (`TransferHandle` and its kinds) and the `TransferError` a failed one raises."""

from __future__ import annotations

import abc
import asyncio
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

# A write without an explicit deadline still ends: never a hang (DESIGN §4).
DEFAULT_TIMEOUT_S = 60.0


class TransferError(RuntimeError):
    """A write that failed, stalled past its deadline or was cancelled; names engine, peer, bytes."""

    def __init__(self, engine: str, peer: str, nbytes: int, reason: str):
        super().__init__(f"KV transfer via {engine} to {peer} ({nbytes} bytes) failed: {reason}")
        self.engine = engine
        self.peer = peer
        self.nbytes = nbytes
        self.reason = reason


class TransferHandle(abc.ABC):
    """One write in flight. `poll()` never blocks; `wait()` blocks at most until the deadline."""

    def __init__(self, engine: str, peer: str, nbytes: int, deadline: float, notify: str):
        self.engine = engine
        self.peer = peer
        self.nbytes = nbytes
        self.deadline = deadline
        self.notify = notify
        self.started = time.monotonic()
        self.finished: float | None = None
        self._error: TransferError | None = None

    def error(self, reason: str) -> TransferError:
        return TransferError(self.engine, self.peer, self.nbytes, reason)

    @abc.abstractmethod
    def _check(self) -> bool:
        """True once the bytes landed; raises TransferError on failure."""

    @abc.abstractmethod
    def _abort(self) -> None:
        """Stop the transfer as far as the engine can (the remote blocks are then undefined)."""

    def _block(self, seconds: float) -> None:
        """Wait up to `seconds` for progress; engines with a future override this."""
        time.sleep(min(seconds, 0.0005))

    def poll(self) -> bool:
        """True when done, False while pending; raises TransferError on failure or deadline."""
        if self._error is not None:
            raise self._error
        if self.finished is not None:
            return True
        try:
            done = self._check()
        except TransferError as e:
            self._error = e
            raise
        if done:
            self.finished = time.monotonic()
            return True
        if time.monotonic() >= self.deadline:
            self._fail(f"deadline passed after {time.monotonic() - self.started:.3f}s")
        return False

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; a failure, the deadline or `timeout` raises TransferError (and cancels)."""
        end = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        while not self.poll():
            left = end - time.monotonic()
            if left <= 0:
                self._fail(f"not done within wait timeout after {time.monotonic() - self.started:.3f}s")
            self._block(left)

    async def wait_async(self) -> None:
        """`wait()` for an event loop: the loop never blocks (engines with a future are woken by it)."""
        await asyncio.to_thread(self.wait)

    def cancel(self) -> None:
        """Abandon the write; the destination blocks are undefined until the peer reuses them safely."""
        if self.finished is None and self._error is None:
            self._abort()
            self._error = self.error("cancelled")

    @property
    def elapsed(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def _fail(self, reason: str) -> None:
        self._abort()
        self._error = self.error(reason)
        raise self._error


class FutureHandle(TransferHandle):
    """A write run by a background thread; the thread checks `cancelled` between chunks."""

    def __init__(self, engine: str, peer: str, nbytes: int, deadline: float, notify: str):
        super().__init__(engine, peer, nbytes, deadline, notify)
        self.future: Future[None] = Future()
        self.cancelled = threading.Event()

    def _check(self) -> bool:
        if not self.future.done():
            return False
        exc = self.future.exception()
        if exc is None:
            return True
        if isinstance(exc, TransferError):
            raise exc
        raise self.error(f"{type(exc).__name__}: {exc}") from exc

    def _abort(self) -> None:
        self.cancelled.set()

    def _block(self, seconds: float) -> None:
        try:
            self.future.exception(timeout=seconds)
        except FutureTimeout:
            return

    async def wait_async(self) -> None:
        """Woken by the writing thread's future, not by polling; a failure or the deadline raises."""
        if not self.poll():
            await asyncio.wait([asyncio.wrap_future(self.future)],
                               timeout=max(0.0, self.deadline - time.monotonic()))
            if not self.poll():
                self._fail(f"deadline passed after {time.monotonic() - self.started:.3f}s")


class DoneHandle(TransferHandle):
    """A write that finished inside `write()` (nothing to move, or a synchronous engine)."""

    def __init__(self, engine: str, peer: str, nbytes: int, notify: str):
        super().__init__(engine, peer, nbytes, time.monotonic() + DEFAULT_TIMEOUT_S, notify)

    def _check(self) -> bool:
        return True

    def _abort(self) -> None:
        return None
