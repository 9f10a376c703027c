"""EngineRunner: the model thread. It owns an LLMEngine; the event loop talks to it by message.

Every engine call runs on this one thread (the engine is not thread-safe and a forward pass
takes milliseconds to seconds), so NATS I/O on the event loop never waits on the model.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from engine.engine import LLMEngine, StepOutput

log = logging.getLogger(__name__)


class EngineRunner:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 on_outputs: Callable[[list[StepOutput]], None]):
        self.engine = engine
        self.loop = loop
        self.on_outputs = on_outputs
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="model", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.calls.put(None)
        self.thread.join(timeout)

    def call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run `fn(engine, *args)` on the model thread; the future resolves on the event loop."""
        fut = self.loop.create_future()
        self.calls.put((fn, args, fut))
        return fut

    def _resolve(self, fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
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

    def _run(self) -> None:
        try:
            while True:
                items = []
                if not self.engine.has_work():
                    items.append(self.calls.get())  # idle: sleep until someone calls
                elif self.engine.last_plan_size == 0:
                    try:  # work is waiting for blocks that only a call (free/abort) can release
                        items.append(self.calls.get(timeout=0.05))
                    except queue.Empty:
                        pass
                while True:
                    try:
                        items.append(self.calls.get_nowait())
                    except queue.Empty:
                        break
                for item in items:
                    if item is None:
                        return
                    self._run_call(item)
                if self.engine.has_work():
                    outputs = self.engine.step()
                    if outputs:
                        self.loop.call_soon_threadsafe(self.on_outputs, outputs)
        except BaseException as e:  # the model thread died: make it loud, the actor exits
            log.exception("model thread failed")
            self.failure = e
            self.loop.call_soon_threadsafe(self.on_outputs, [])
