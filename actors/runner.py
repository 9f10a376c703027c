"""EngineRunner: the model loop. It owns an LLMEngine; the event loop talks to it by message.

Every engine call runs on one thread (the engine is not thread-safe and a forward pass takes
milliseconds to seconds), so NATS I/O on the event loop never waits on the model. That thread is
the process's main thread and the event loop runs beside it: OpenMP/MKL kernels called from a
second thread after the main thread has used them ran ~1.6x slower here (decode steps 60 ms vs
30 ms), so the model keeps the main thread.

A decode worker whose cores a prefill worker borrows lends them whenever it waits, and takes them back
before each step; with ``lend_step_s`` it starts a step at most that often while a long prompt is
prefilled elsewhere for it, so the borrower gets whole layers between its steps (runtime/borrowing.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from engine.engine import LLMEngine
from engine.sequence import StepOutput
from runtime.borrowing import LentCores

log = logging.getLogger(__name__)
_WAKE = ("wake",)  # a queued item that only makes the model loop look again
#: pace steps only while a prompt this long is prefilled elsewhere: a shorter one is done before lending pays
LEND_MIN_TOKENS = 512


class StepInbox:
    """What the event loop hands the engine's next step (a KV connector's news): posting an item wakes the model
    thread, which takes them all at the step's start."""

    def __init__(self, runner: EngineRunner) -> None:
        self.runner = runner
        self._items: collections.deque = collections.deque()

    def post(self, item: Any) -> None:
        self._items.append(item)
        self.runner.wake()

    def take(self) -> list:
        """On the model thread: everything posted so far, in order."""
        return [self._items.popleft() for _ in range(len(self._items))]


class EngineRunner:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 on_outputs: Callable[[list[StepOutput], float], None],
                 on_call_done: Callable[[], None] | None = None, lent: LentCores | None = None,
                 lend_step_s: float = 0.0):
        self.engine = engine
        self.lent = lent  # the cores this worker lends a prefill worker while it waits (runtime/borrowing.py)
        self.lend_step_s = lend_step_s
        self.loop = loop
        self.on_outputs = on_outputs
        #: on the event loop after each call: a call (abort, free, release) may have freed blocks
        self.on_call_done = on_call_done
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.failure: BaseException | None = None

    def stop(self) -> None:
        """Make `run` return after the calls queued before this one."""
        self.calls.put(None)

    def wake(self) -> None:
        """Make the model thread step again: the engine's KV connector has news for it (engine/kv_connector.py)."""
        self.calls.put(_WAKE)

    def call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run `fn(engine, *args)` on the model thread; the future resolves on the event loop."""
        fut = self.loop.create_future()
        self.calls.put((fn, args, fut))
        return fut

    def hand_out(self, outputs: list[StepOutput], step_s: float = 0.0) -> None:
        """Give outputs to the event loop; from the model thread, so they keep the order they were made in.
        ``step_s``: wall seconds of the engine step that made them (0 for outputs made by a call)."""
        self.loop.call_soon_threadsafe(self.on_outputs, outputs, step_s)

    def _resolve(self, fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
        if self.on_call_done is not None:
            self.on_call_done()
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _run_call(self, item) -> None:
        fn, args, fut = item
        try:
            result, exc = fn(self.engine, *args), None
        except Exception as e:  # handed to the awaiting coroutine, which reports it
            result, exc = None, e
        self.loop.call_soon_threadsafe(self._resolve, fut, result, exc)

    def _lend(self) -> None:
        if self.lent is not None:
            self.lent.lend()

    def _paced(self) -> bool:
        """Whether the next step waits out ``lend_step_s`` from this one's start: while a long prompt is
        prefilled elsewhere for this worker, by a borrower of its cores."""
        return (self.lent is not None and self.lend_step_s > 0
                and self.engine.scheduler.remote_tokens() >= LEND_MIN_TOKENS)

    def _until(self, resume_at: float) -> list:
        """The calls that come before ``resume_at`` (monotonic), or until a stop or the KV connector's news (a
        remote prompt landed: its first token need not wait out the pace)."""
        items: list = []
        while (left := resume_at - time.monotonic()) > 0:
            try:
                items.append(self.calls.get(timeout=left))
            except queue.Empty:
                break
            if items[-1] is None or items[-1] is _WAKE:
                break
        return items

    def run(self) -> None:
        """Serve calls and step the engine until `stop` (blocking; call it on the main thread)."""
        try:
            resume_at = 0.0
            while True:
                items = []
                if not self.engine.has_work() or self.engine.last_plan_size == 0:
                    # idle, or the last step (after the last call) found nothing to compute: the work waits for
                    # blocks only a call (free, abort) or the KV connector (a landed prefill, a released quarantine)
                    # releases. Sleep until one comes; signal handlers still run on this thread meanwhile.
                    self._lend()
                    items.append(self.calls.get())
                elif resume_at > time.monotonic():  # paced: the borrower has the cores until then
                    self._lend()
                    items += self._until(resume_at)
                while True:
                    try:
                        items.append(self.calls.get_nowait())
                    except queue.Empty:
                        break
                for item in items:
                    if item is None:
                        return
                    if item is not _WAKE:
                        self._run_call(item)
                if self.engine.has_work() or any(item is _WAKE for item in items):
                    if self.lent is not None:
                        self.lent.take()
                    started = time.monotonic()
                    outputs = self.engine.step()
                    # even with no outputs: a step may have placed a prompt or freed blocks (the pull loop waits on it)
                    self.hand_out(outputs, time.monotonic() - started)
                    resume_at = started + self.lend_step_s if self._paced() else 0.0
        except BaseException as e:  # the model thread died: make it loud, the actor exits
            log.exception("model thread failed")
            self.failure = e
            self.loop.call_soon_threadsafe(self.on_outputs, [], 0.0)
        finally:
            if self.lent is not None:
                self.lent.close()
