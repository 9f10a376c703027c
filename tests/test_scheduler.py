"""The scheduler's step plans: decodes first, then prefill chunks shortest remaining first."""

from __future__ import annotations

from engine.params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from kv.blocks import BlockPool


def seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4))


def run(sched: Scheduler) -> dict[str, int]:
    """One step: plan, then commit what was planned (as the engine does after the forward pass)."""
    plan = sched.schedule()
    for s, n in plan:
        sched.commit(s, n)
    return {s.request_id: n for s, n in plan}


def make(budget: int = 64) -> Scheduler:
    return Scheduler(BlockPool(64, 16, enable_prefix_cache=False), max_batch=8, max_step_tokens=budget)


def test_short_prompt_is_not_held_behind_a_long_prefill():
    sched = make()
    sched.add(seq("long", 300))
    assert run(sched) == {"long": 64}
    sched.add(seq("short", 20))
    # the short prompt takes its whole prefill this step, and the step is not padded with the long one
    assert run(sched) == {"short": 20}
    sched.running[1].output_ids.append(7)  # short's first token: it decodes from now on
    assert run(sched) == {"short": 1, "long": 63}


def test_arrival_order_among_equal_prompts_and_the_budget_holds():
    sched = make(budget=50)
    for rid in ("a", "b", "c"):
        sched.add(seq(rid, 30))
    plan = sched.schedule()
    assert [(s.request_id, n) for s, n in plan] == [("a", 30)]  # b does not fit: it waits, whole, for the next
    assert [s.request_id for s in sched.waiting] == ["c"]  # a and b together fill the budget: c waits
    for s, n in plan:
        sched.commit(s, n)
    sched.finish(plan[0][0])
    assert [(s.request_id, n) for s, n in sched.schedule()] == [("b", 30)]


def test_long_prompt_still_finishes_while_short_ones_keep_coming():
    sched = make(budget=64)
    sched.add(seq("long", 200))
    long = sched.waiting[0]
    progress = []
    for step in range(12):
        sched.add(seq(f"s{step}", 8))
        run(sched)
        progress.append(long.num_computed)
        for s in list(sched.running):
            if s is not long and s.num_computed == s.num_tokens:
                sched.finish(s)  # short ones end at their first token (prefill-only worker)
    # its first chunk, then passed over 3 steps at a time, taking the rest of every 4th step's budget,
    # until what is left fits beside a short one
    assert progress == [64, 64, 64, 64, 120, 120, 120, 120, 176, 200, 200, 200]


def test_a_whole_prefill_takes_its_prompt_in_one_step_past_the_budget():
    sched = make(budget=64)
    whole = seq("whole", 300)
    whole.whole_prefill = True
    sched.add(seq("short", 20))
    sched.add(whole)
    assert run(sched) == {"short": 20, "whole": 300}  # the short prompt, then the whole one past the budget
    sched.add(seq("next", 20))
    assert run(sched) == {"next": 20}
