"""The scheduler's step plans: decodes first, then prefill chunks shortest remaining first."""

from __future__ import annotations

from engine.params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from kv.blocks import BlockPool, prefix_hashes
from kv.layout import KVLayout


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


# the tiny Gemma's shape: a global layer and two local ones with a window of one block
WINDOWED = KVLayout("g", "float32", 16, 3, 1, 8, groups=((1,), (0,), (2,)), windows=(0, 16, 16))


def live(s: Sequence) -> list[int]:
    """Blocks each group holds for the sequence."""
    return [len(t) - s.live_from[g] for g, t in enumerate(s.block_tables)]


def test_windowed_groups_hold_only_their_window():
    blocks = BlockPool(3 * 20, 16)
    sched = Scheduler(blocks, max_batch=8, max_step_tokens=32, layout=WINDOWED)
    sched.add(seq("a", 100))
    a = sched.waiting[0]
    for _ in range(4):  # the prompt's blocks are placed at admission; after each chunk the local groups give
        run(sched)      # back those that left the window, the global group keeps every block
        assert live(a) == [7] + [7 - (a.num_computed + 1 - 16) // 16] * 2
    assert a.num_computed == 100 and live(a) == [7, 2, 2]  # positions 85..100: blocks 5 and 6
    for tok in range(40):  # decoding: a block every 16 tokens for each group, the local ones give one back
        a.output_ids.append(tok)
        run(sched)
        assert max(live(a)[1:]) <= 2
    assert live(a)[0] == 9 and blocks.num_used == 9 + sum(live(a)[1:])
    sched.finish(a)
    blocks.check_idle()
    # the same prompt again: the cache serves every full block, the local groups' from their window only
    sched.add(seq("b", 100))
    b = sched.waiting[0]
    assert sched.place(b) and b.num_cached == 96 and live(b) == [7, 2, 2]
    sched.free(b)
    blocks.check_idle()


def served_then_evicted(evict: int) -> tuple[Scheduler, Sequence]:
    """A 100-token prompt served to the end, then `evict` cached blocks evicted (oldest first)."""
    blocks = BlockPool(3 * 20, 16)
    sched = Scheduler(blocks, max_batch=8, max_step_tokens=16, layout=WINDOWED)  # a block per chunk
    sched.add(seq("a", 100))
    a = sched.waiting[0]
    while a.num_computed < 100:
        run(sched)
    sched.finish(a)
    blocks.release(blocks.allocate(len(blocks.free) + evict))
    # shares a's first 3 blocks (48 tokens), then differs
    return sched, Sequence("c", list(range(1, 51)) + [999] * 30, SamplingParams(max_tokens=4))


def test_a_windowed_prefix_is_reused_while_its_window_is_cached():
    # the local groups' blocks that left the window reached the cache first (block 0 of each, then block 1...),
    # so they are evicted first; the token after 48 cached ones attends to block 2 only, in a local group
    sched, c = served_then_evicted(evict=4)
    assert sched.place(c) and c.num_cached == 48 and live(c) == [5, 3, 3]
    sched.free(c)
    sched, c = served_then_evicted(evict=6)  # block 2 of the local groups is gone: no prefix has its window
    assert sched.blocks.peek_prefix(prefix_hashes(c.prompt_ids, 16)[:3]) == 3
    assert sched.place(c) and c.num_cached == 0 and live(c) == [5, 5, 5]


def test_a_budget_with_one_token_left_still_moves_a_prompt_on():
    """A step with one token of budget left computes one token of the waiting prompt (the model runner takes
    it for a chunk, not a decode row: engine/model_runner.py `decodes`), and a budget of 1 prefills at all."""
    sched = make(budget=4)
    for rid in ("a", "b", "c"):
        sched.add(seq(rid, 1))
    sched.add(seq("long", 40))
    assert run(sched) == {"a": 1, "b": 1, "c": 1}
    for s in sched.running[:3]:
        s.output_ids.append(7)  # a, b and c decode: one token of the budget is left
    assert run(sched) == {"a": 1, "b": 1, "c": 1, "long": 1}
    one = make(budget=1)
    one.add(seq("p", 3))
    assert [run(one) for _ in range(3)] == [{"p": 1}] * 3


def test_a_remote_prompt_is_placed_outside_the_budget_and_lands_in_the_batch():
    """A prompt another worker computes takes blocks, not step tokens: it is placed even when decode rows use the
    whole budget, never planned while it waits, and joins the batch with its prompt computed once it lands."""
    from engine.sequence import SeqStatus

    def decode_step() -> dict[str, int]:
        for s in sched.running:
            s.output_ids.append(7)  # each running sequence's token of the step before
        return run(sched)

    sched = make(budget=4)
    for rid in ("d1", "d2"):
        sched.add(seq(rid, 2))
    assert run(sched) == {"d1": 2, "d2": 2}
    sched.max_step_tokens = 2
    remote = seq("r", 40)
    remote.remote = True
    sched.add(remote)
    assert decode_step() == {"d1": 1, "d2": 1}  # two rows fill the budget
    assert sched.placed_remote == [remote] and sched.remote == [remote]
    assert remote.status is SeqStatus.WAITING_FOR_REMOTE_KV and len(remote.block_tables[0]) == 3
    assert decode_step() == {"d1": 1, "d2": 1} and sched.placed_remote == []
    free = sched.blocks.num_free
    sched.landed(remote)
    assert remote.num_computed == 40 and sched.blocks.num_free == free and sched.remote == []
    assert decode_step() == {"d1": 1, "d2": 1, "r": 1}  # its first token, the prefill worker's, then decodes
