"""Quarantine: blocks of a decode worker's pool that a prefill attempt may still write into.

A remote prefill that ends without its K/V (a failure, a timeout, a cancel once its job went out) leaves blocks a
late write may still hit. The engine holds them under the attempt's tag (`placement_ended`, on the model thread)
and frees them once `released()` names the tag: when the attempt answers that it writes no more, its write grant
is enough to refuse a late byte (TCP), or its deadline and a grace have passed. The release starts only once the
engine holds the blocks, so a tag is never freed before it is held.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine

from actors.runner import EngineRunner, StepInbox
from actors.seen import SeenIds
from kv.transfer.base import TransferEngine
from kv.transfer.grants import GRANT_CHECKED

QUARANTINE_GRACE_S = 5.0


class Quarantine:
    """The tags of attempts whose blocks the engine holds, and when each may go."""

    def __init__(self, transfer: TransferEngine, runner: EngineRunner,
                 spawn: Callable[[Coroutine], asyncio.Task]) -> None:
        self.transfer, self.loop, self.spawn = transfer, runner.loop, spawn
        self.held: set[str] = set()  # tags whose blocks the engine holds: they may still be written
        self.attempts_over = SeenIds()  # attempts whose writer said it writes no more
        # placements that end without their K/V: request -> (tag, deadline, mechanism) of the blocks to hold
        self._ending: dict[str, tuple[str, float, str]] = {}
        self._released = StepInbox(runner)  # tags the engine may free

    def when_ended(self, rid: str, tag: str, deadline: float, mechanism: str) -> None:
        """When request ``rid``'s placement ends (a result, an abort), the engine holds its fresh blocks under
        ``tag`` ('' frees them); the first word stands (a result's, over the abort that may follow it)."""
        if tag:
            self._ending.setdefault(rid, (tag, deadline, mechanism))

    def placement_ended(self, rid: str) -> str:
        """On the model thread: the tag request ``rid``'s fresh blocks are held under now ('' none)."""
        tag, deadline, mechanism = self._ending.pop(rid, ("", 0.0, ""))
        if tag:  # its release may start only now that the engine holds the blocks under the tag
            self.loop.call_soon_threadsafe(self.hold, tag, deadline, mechanism)
        return tag

    def released(self) -> list[str]:
        """On the model thread: the tags the engine may free now."""
        return self._released.take()

    def hold(self, tag: str, deadline: float, mechanism: str = "") -> None:
        """The engine holds attempt ``tag``'s blocks: let them go once it answers (it has stopped writing) or its
        deadline passes.

        The answer may already be here: a cancel and the writer's PrefillDone race. A writer that uses a
        mechanism which refuses a write without its grant (TCP: ``kv.transfer.grants.GRANT_CHECKED``) cannot
        land a byte once the attempt's grant is revoked, so its blocks are free at once.
        """
        self.held.add(tag)
        granted_only = set(self.transfer.mechanisms()) <= GRANT_CHECKED  # this pool takes no other write
        if tag in self.attempts_over or mechanism in GRANT_CHECKED or granted_only:
            self.release(tag)
        else:
            self.spawn(self._release_after(tag, max(0.0, deadline - time.time()) + QUARANTINE_GRACE_S))

    def over(self, tag: str) -> None:
        """Attempt ``tag`` writes no more (its answer said so, or its job was withdrawn unread)."""
        self.attempts_over.add(tag)
        self.release(tag)

    async def _release_after(self, tag: str, delay: float) -> None:
        await asyncio.sleep(delay)
        self.release(tag)

    def release(self, tag: str) -> None:
        """The engine may free attempt ``tag``'s blocks: at its next step, for which it is woken."""
        if tag in self.held:
            self.held.discard(tag)
            self._released.post(tag)
