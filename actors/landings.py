"""Landings: KV writes into a decode worker's pool that have fully landed, as events a remote prefill waits on.

The transfer engine's completion descriptors wake the event loop; only a transfer engine that sees landings by
polling alone (NIXL without a progress thread) is polled, and only while a write through it is expected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine

from actors.base import bad_messages
from actors.seen import SeenIds
from kv.transfer.base import TransferEngine

POLL_S = 0.001  # landing poll of a transfer engine that needs it, while a write through it is expected


class Landings:
    """KV writes into this worker's pool that have fully landed, delivered as events.

    The transfer engine's completion descriptors wake `collect` on the event loop; a waiter
    (`wait`) is resolved at once, a tag nobody waits for yet is remembered for when one does.
    """

    def __init__(self, transfer: TransferEngine, spawn: Callable[[Coroutine], asyncio.Task]) -> None:
        self.transfer, self.spawn = transfer, spawn
        self.landed = SeenIds()
        self.waiters: dict[str, asyncio.Future] = {}
        self.polled: set[str] = set()  # expected writes whose landing only polling shows
        self._poller: asyncio.Task | None = None
        self._fds: list[int] = []

    async def watch(self) -> None:
        """Wake on the engine's completion descriptors until cancelled (the worker leaving)."""
        loop = asyncio.get_running_loop()
        self._fds = self.transfer.completion_fds()
        for fd in self._fds:
            loop.add_reader(fd, self.collect)
        try:
            await loop.create_future()
        finally:
            for fd in self._fds:
                loop.remove_reader(fd)
            self._fds = []

    def collect(self, tags: list[str] | None = None) -> None:
        """Take the engine's new notices (or ``tags``, read elsewhere) and wake their waiters."""
        if tags is None:
            try:
                tags = self.transfer.completed()
            except Exception as e:  # this reader must outlive one bad read, or no remote prefill lands again
                bad_messages.warning("kv completions", "reading KV transfer completions failed: %r", e)
                return
        for tag in tags:
            fut = self.waiters.pop(tag, None)
            if fut is not None and not fut.done():
                fut.set_result(True)
            else:
                self.landed.add(tag)

    def expect(self, tag: str, mechanism: str = "") -> None:
        """A write tagged ``tag`` may come (through ``mechanism``, '' while unknown): poll if only that shows it."""
        if self.transfer.needs_polling_for(mechanism):
            self.polled.add(tag)
            if self._poller is None or self._poller.done():
                self._poller = self.spawn(self._poll())
        else:
            self.polled.discard(tag)

    def settled(self, tag: str) -> None:
        """No write tagged ``tag`` is waited for any more."""
        self.polled.discard(tag)
        fut = self.waiters.pop(tag, None)
        if fut is not None and not fut.done():
            fut.set_result(False)

    async def wait(self, tag: str, timeout: float) -> bool:
        """True once write ``tag`` has landed; False at the timeout or when `settled` gives up on it."""
        if tag not in self.landed and self._fds:
            self.collect()  # its notice is often here already: the writer sent it before its reply
        if tag in self.landed:
            self.landed.discard(tag)
            return True
        fut = asyncio.get_running_loop().create_future()
        self.waiters[tag] = fut
        try:
            return await asyncio.wait_for(fut, max(0.0, timeout))
        except asyncio.TimeoutError:
            return False
        finally:
            if self.waiters.get(tag) is fut:
                del self.waiters[tag]

    async def _poll(self) -> None:
        while self.polled:
            try:
                tags = await asyncio.to_thread(self.transfer.completed)
            except Exception as e:  # keep polling: the next read may work
                bad_messages.warning("kv completions", "reading KV transfer completions failed: %r", e)
                tags = []
            self.collect(tags)
            await asyncio.sleep(POLL_S)
