"""actors/runner.py: the model thread tells the event loop when something may have freed room."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

from actors.runner import EngineRunner
from runtime.borrowing import CoreLease, LentCores
from tests.harness.wait import wait_until


class IdleEngine:
    """An engine with nothing to step: only calls reach it."""

    last_plan_size = 0
    freed = 0

    def has_work(self) -> bool:
        return False

    def step(self) -> list:
        raise AssertionError("an idle engine is never stepped")


def test_every_call_and_every_step_wakes_the_loop_even_without_outputs() -> None:
    """The pull loop waits on these (no polling): a call that freed blocks (an abort, a quarantine let go)
    must wake it as surely as a step that made outputs, and a step without outputs too (it may have placed a
    prompt)."""
    async def go() -> tuple[list[str], int]:
        loop = asyncio.get_running_loop()
        woke: list[str] = []
        outputs: list[int] = []
        engine = IdleEngine()
        runner = EngineRunner(engine, loop, lambda outs, step_s: outputs.append(len(outs)),
                              lambda: woke.append("call"))
        thread = threading.Thread(target=runner.run, daemon=True)
        thread.start()

        def free(e: IdleEngine) -> int:
            e.freed += 3
            return e.freed

        assert await runner.call(free) == 3
        assert woke == ["call"]  # before the awaiting coroutine went on
        runner.hand_out([], 0.01)  # a step with no outputs still reaches the loop
        await asyncio.sleep(0.05)
        runner.stop()
        await asyncio.to_thread(thread.join, 10)
        return woke, len(outputs)

    woke, steps = asyncio.run(go())
    assert woke == ["call"] and steps == 1


def test_a_failed_call_wakes_the_loop_too() -> None:
    async def go() -> list[str]:
        woke: list[str] = []
        runner = EngineRunner(SimpleNamespace(has_work=lambda: False, last_plan_size=0),
                              asyncio.get_running_loop(), lambda outs, step_s: None, lambda: woke.append("call"))
        thread = threading.Thread(target=runner.run, daemon=True)
        thread.start()

        def boom(e: object) -> None:
            raise RuntimeError("boom")

        try:
            await runner.call(boom)
        except RuntimeError as e:
            assert str(e) == "boom"
        runner.stop()
        await asyncio.to_thread(thread.join, 10)
        return woke

    assert asyncio.run(go()) == ["call"]


class StuckEngine:
    """An engine whose work waits for blocks: every step plans nothing until a call frees some."""

    def __init__(self) -> None:
        self.steps = 0
        self.last_plan_size = 0
        self.free_blocks = 0

    def has_work(self) -> bool:
        return True

    def step(self) -> list:
        self.steps += 1
        self.last_plan_size = 1 if self.free_blocks else 0
        return []


def test_work_waiting_for_blocks_is_stepped_again_only_after_a_call() -> None:
    """A step that planned nothing is not retried on a timer (no 20 Hz spin while the pool is full): the
    model thread sleeps until a call (a free, an abort, a landed prefill) and then steps at once."""
    async def go() -> list[int]:
        engine = StuckEngine()
        runner = EngineRunner(engine, asyncio.get_running_loop(), lambda outs, step_s: None)
        thread = threading.Thread(target=runner.run, daemon=True)
        thread.start()
        seen = [await runner.call(lambda e: e.steps)]  # stepped once after this call, planning nothing
        await asyncio.sleep(0.3)
        seen.append(engine.steps)

        def free(e: StuckEngine) -> int:
            e.free_blocks = 4
            return e.steps

        seen.append(await runner.call(free))
        await asyncio.to_thread(wait_until, lambda: engine.steps > 5, 10, "steps once blocks were free", 0.01)
        runner.stop()
        await asyncio.to_thread(thread.join, 10)
        return seen

    assert asyncio.run(go()) == [0, 1, 1]


class PacedEngine:
    """Always work; ``remote`` prompt tokens computed elsewhere for it; when each step began, and whether its
    core was kept then."""

    last_plan_size = 1

    def __init__(self) -> None:
        self.remote = 600
        self.starts: list[float] = []
        self.kept: list[bool] = []
        self.namespace = f"test-{uuid.uuid4().hex[:8]}"
        self.lease = CoreLease(self.namespace, 7)  # what a borrower of core 7 reads
        self.scheduler = SimpleNamespace(remote_tokens=lambda: self.remote)

    def start(self, lend_step_s: float) -> tuple[EngineRunner, threading.Thread]:
        """A runner on this engine lending core 7 (call on the event loop), its model loop on a thread."""
        runner = EngineRunner(self, asyncio.get_running_loop(), lambda outs, step_s: None,
                              lent=LentCores(self.namespace, [7]), lend_step_s=lend_step_s)
        thread = threading.Thread(target=runner.run, daemon=True)
        thread.start()
        return runner, thread

    def has_work(self) -> bool:
        return True

    def step(self) -> list:
        self.starts.append(time.monotonic())
        self.kept.append(not self.lease.lent())
        return []


def test_a_lending_decode_worker_paces_its_steps_only_while_a_long_prompt_is_prefilled_elsewhere() -> None:
    """While 512+ prompt tokens are prefilled elsewhere for it, a step starts at most every ``lend_step_s``
    and the core is lent in between (kept during each step); without them, steps run back to back."""
    engine = PacedEngine()
    observer = engine.lease

    async def go() -> None:
        runner, thread = engine.start(0.1)
        await asyncio.to_thread(wait_until, lambda: len(engine.starts) >= 6, 30, "six paced steps", 0.01)
        await asyncio.to_thread(wait_until, observer.lent, 10, "the core lent between paced steps", 0.005)
        paced = len(engine.starts)
        engine.remote = 100  # a short prompt: not worth lending for
        await asyncio.to_thread(wait_until, lambda: len(engine.starts) >= paced + 50, 30, "steps back to back", 0.01)
        runner.stop()
        await asyncio.to_thread(thread.join, 10)
        engine.paced = paced

    try:
        asyncio.run(go())
        gaps = [b - a for a, b in zip(engine.starts, engine.starts[1:])]
        paced_gaps, free_gaps = gaps[:engine.paced - 2], gaps[engine.paced:]
        assert min(paced_gaps) >= 0.099, paced_gaps
        assert sorted(free_gaps)[len(free_gaps) // 2] < 0.05, free_gaps
        assert all(engine.kept)  # every step ran on a core it had taken back
        assert not Path(observer.path).exists()  # the runner's end took the file away
    finally:
        observer.close()


def test_news_from_the_kv_connector_ends_a_paced_wait() -> None:
    """A remote prompt that landed (the connector's wake) is stepped at once, not after the pace."""
    engine = PacedEngine()

    async def go() -> None:
        runner, thread = engine.start(30.0)
        await asyncio.to_thread(wait_until, lambda: len(engine.starts) >= 1, 10, "the first step", 0.01)
        runner.wake()
        await asyncio.to_thread(wait_until, lambda: len(engine.starts) >= 2, 10, "a step right after the news", 0.01)
        runner.stop()
        await asyncio.to_thread(thread.join, 10)

    try:
        asyncio.run(go())
    finally:
        engine.lease.close()
