"""Quarantine: blocks of a decode worker's pool that a prefill attempt may still write into.

A remote prefill that ends without its K/V (a failure, a timeout, a cancel once its job went out) leaves blocks a
late write may still hit. The engine holds them under the attempt's tag (`placement_ended`, on the model thread)
and frees them once `released()` names the tag: when the attempt answers that it writes no more, its write grant
is enough to refuse a late byte (TCP), or its deadline and a grace have passed. The release starts only once the
engine holds the blocks, so a tag is never freed before it is held. A pool job nobody took is withdrawn from the
pool and claimed (`withdraw_job`): won, no writer will come.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import nats.errors
from nats.js.errors import APIError

from actors.runner import EngineRunner, StepInbox
from actors.seen import SeenIds
from bus.prefill_messages import PrefillJob
from bus.streams import claim, claim_key, taken_already
from bus.subjects import Subjects
from kv.transfer.base import TransferEngine
from kv.transfer.grants import GRANT_CHECKED

log = logging.getLogger(__name__)

QUARANTINE_GRACE_S = 5.0
#: a job nobody took is withdrawn from the pool, retried this long while the pool has no leader
WITHDRAW_FOR_S = 15.0


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


async def withdraw_job(nc: Any, subjects: Subjects, seq: int, tag: str, claimer: str) -> bool:
    """Take prefill job ``tag`` (message ``seq`` of the prefill pool) that nobody took out of the pool: a prefill
    worker that comes later must not compute it, and the pool's backlog, what autoscalers read, must not count it.
    Then claim it (as ``claimer``) as its prefill worker would; True when the claim is won: no prefill worker
    serves it (one that fetched it before the delete drops its copy), so its quarantined blocks may be freed at
    once instead of at the job's deadline.

    The pool may be electing a leader (its member just died): tried again each second for
    ``WITHDRAW_FOR_S``; a job a prefill worker took meanwhile is gone, and its answer frees the blocks.
    """
    js = nc.jetstream(timeout=2.0)
    give_up = time.monotonic() + WITHDRAW_FOR_S
    while True:
        try:
            await js.delete_msg(subjects.prefill_stream, seq)
            break
        except APIError as e:
            if taken_already(e):
                log.info("prefill job %s left the pool before it was withdrawn", tag)
                return False
            error: Exception = e  # no leader yet
        except (nats.errors.Error, asyncio.TimeoutError) as e:  # the bus is away
            error = e
        if time.monotonic() >= give_up:
            log.warning("could not withdraw prefill job %s from the pool: %r", tag, error)
            return False
        await asyncio.sleep(1.0)
    try:
        first = await claim(nc, subjects, claim_key(PrefillJob, tag), claimer)
    except Exception as e:  # the claims stream is away: the blocks wait for the job's deadline
        log.info("withdrew prefill job %s from the pool; cannot claim it (%r)", tag, e)
        return False
    log.info("withdrew prefill job %s from the pool%s", tag, "" if first else "; a prefill worker had claimed it")
    return first
