"""Continuous batching: admit by free blocks, chunk prefills under a token budget (shortest remaining
first), preempt by recompute."""

from __future__ import annotations

import logging
from collections import deque

from engine.sequence import SeqStatus, Sequence
from kv.blocks import BlockPool, block_hash, prefix_hashes

log = logging.getLogger(__name__)
WHOLE_PREFILL_MAX_TOKENS = 8192  # a whole_prefill sequence's step, past the budget
MAX_PASSED_OVER = 3  # steps an unfinished prompt may be passed over for shorter ones before it pads a step


class Scheduler:
    def __init__(self, blocks: BlockPool, max_batch: int, max_step_tokens: int):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def schedule(self) -> list[tuple[Sequence, int]]:
        """This step's work: (sequence, number of new tokens to compute)."""
        budget = self.max_step_tokens
        plan: list[tuple[Sequence, int]] = []
        # Decodes first: one token each, plus a block when the next slot opens one.
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.num_tokens - seq.num_computed != 1:
                continue
            while len(seq.block_table) * self.block_size <= seq.num_computed:
                if self.blocks.num_free:
                    seq.block_table += self.blocks.allocate(1)
                    continue
                victim = self._newest_running()
                self.preempt(victim)
                plan = [(s, n) for s, n in plan if s is not victim]
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                plan.append((seq, 1))
                budget -= 1
        budget = max(budget, 0)
        # Prefills, shortest remaining first. Waiting sequences are admitted in arrival order while
        # slots and blocks last and the prompts admitted so far do not fill the budget. Then a step
        # either finishes the prompts that fit, or, when none fits, computes a chunk of the shortest:
        # a short prompt is neither held behind a long one's chunks nor padded with them (on a CPU a
        # step's time grows with its tokens, so padding would delay the short one's first token). A
        # long prompt passed over MAX_PASSED_OVER steps in a row takes the rest of the next one's budget.
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        admitted_tokens = 0
        while self.waiting and admitted_tokens < budget and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            self.running.append(seq)
            prefilling.append(seq)
            admitted_tokens += seq.num_tokens - seq.num_computed
        prefilling.sort(key=lambda s: s.num_tokens - s.num_computed)  # stable: arrival order among equals
        finishing = False
        planned = set()
        for seq in prefilling:
            remaining = seq.num_tokens - seq.num_computed
            room = max(budget, WHOLE_PREFILL_MAX_TOKENS) if seq.whole_prefill else budget
            if room <= 0:
                break
            if finishing and remaining > room and seq.passed_over < MAX_PASSED_OVER:
                continue
            n = min(remaining, room)
            plan.append((seq, n))
            planned.add(seq.request_id)
            budget -= n
            finishing = finishing or n == remaining
        for seq in prefilling:
            seq.passed_over = 0 if seq.request_id in planned else seq.passed_over + 1
        return plan

    def _admit(self, seq: Sequence) -> bool:
        """Reserve blocks for the whole prompt, reusing the prefix cache. False if they don't fit."""
        placed = self.place(seq)
        if placed is None:
            return False
        seq.status = SeqStatus.RUNNING
        return True

    def place(self, seq: Sequence) -> list[int] | None:
        """Match the prefix cache and allocate the rest; returns the fresh blocks, or None if short."""
        tokens = seq.all_ids
        hashes = prefix_hashes(tokens, self.block_size)
        usable = min(self.blocks.peek_prefix(hashes), (len(tokens) - 1) // self.block_size)
        fresh_needed = self.blocks_needed(len(tokens)) - usable
        if fresh_needed > self.blocks.num_free - self._cached_in_lru(hashes[:usable]):
            return None
        matched = self.blocks.match_prefix(hashes[:usable])
        fresh = self.blocks.allocate(fresh_needed)
        seq.block_table = matched + fresh
        seq.block_hashes = hashes[:usable]
        seq.num_computed = seq.num_cached = usable * self.block_size
        if seq.cached_prompt_tokens is None:  # a resumed sequence re-matches its own blocks: not a hit
            seq.cached_prompt_tokens = min(seq.num_cached, len(seq.prompt_ids))
        return fresh

    def _cached_in_lru(self, hashes: list[bytes]) -> int:
        """Matched blocks that currently count as free (they stop counting once referenced)."""
        return sum(1 for h in hashes if self.blocks.ref[self.blocks.cached[h]] == 0)

    def _newest_running(self) -> Sequence:
        return max((s for s in self.running if s.status is SeqStatus.RUNNING), key=lambda s: s.arrival)

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it re-enters the queue front and recomputes its KV later."""
        self.blocks.release(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        log.info("preempted %s (recompute %d tokens)", seq.request_id, seq.num_tokens)

    def commit(self, seq: Sequence, n: int) -> None:
        """`n` more tokens of `seq` now have K/V in the pool: name newly full blocks for reuse."""
        seq.num_computed += n
        full = seq.num_computed // self.block_size
        if len(seq.block_hashes) < full:
            for i in range(len(seq.block_hashes), full):
                chunk = seq.tokens(i * self.block_size, (i + 1) * self.block_size)
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                h = block_hash(parent, chunk)
                seq.block_hashes.append(h)
                self.blocks.register(seq.block_table[i], h)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.block_table)
        seq.block_table = []
        seq.status = SeqStatus.FINISHED
