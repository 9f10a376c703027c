"""Continuous batching: admit by free blocks, chunk prefills under a token budget (shortest remaining
first), preempt by recompute."""

from __future__ import annotations

import logging
from collections import deque

from engine.sequence import SeqStatus, Sequence
from kv.blocks import NULL_BLOCK, BlockPool, block_hash, group_key, prefix_hashes
from kv.layout import KVLayout

log = logging.getLogger(__name__)
WHOLE_PREFILL_MAX_TOKENS = 8192  # a whole_prefill sequence's step, past the budget
MAX_PASSED_OVER = 3  # steps an unfinished prompt may be passed over for shorter ones before it pads a step


class Scheduler:
    def __init__(self, blocks: BlockPool, max_batch: int, max_step_tokens: int, layout: KVLayout | None = None):
        self.blocks = blocks
        self.block_size = blocks.block_size
        # KV groups (kv.layout): a sequence holds a block of each per block_size tokens, the windowed ones only
        # inside their window
        self.layout = layout or KVLayout("", "float32", blocks.block_size, 1, 1, 1)
        self.groups = self.layout.num_groups
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.remote: list[Sequence] = []  # placed, waiting for their prompt's K/V from another worker
        self.placed_remote: list[Sequence] = []  # of those, the ones the last `schedule` placed
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.remote)

    def remote_tokens(self) -> int:
        """Prompt tokens placed here that other workers are computing now."""
        return sum(s.num_tokens - s.num_cached for s in self.remote)

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
            while len(seq.block_tables[0]) * self.block_size <= seq.num_computed:
                if self.blocks.num_free >= self.groups:
                    self._grow(seq)
                    continue
                victim = self._newest_running()
                self.preempt(victim)
                plan = [(s, n) for s, n in plan if s is not victim]
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                self._room_for_draft(seq)
                plan.append((seq, 1 + len(seq.draft)))
                budget -= 1 + len(seq.draft)
        budget = max(budget, 0)
        # Prefills, shortest remaining first. Waiting sequences are admitted in arrival order while
        # slots and blocks last and the prompts admitted so far do not fill the budget. Then a step
        # either finishes the prompts that fit, or, when none fits, computes a chunk of the shortest:
        # a short prompt is neither held behind a long one's chunks nor padded with them (on a CPU a
        # step's time grows with its tokens, so padding would delay the short one's first token). A
        # long prompt passed over MAX_PASSED_OVER steps in a row takes the rest of the next one's budget.
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        admitted_tokens = 0
        self.placed_remote = []
        while self.waiting and len(self.running) + len(self.remote) < self.max_batch:
            seq = self.waiting[0]
            if seq.remote:  # placed only, outside the budget: another worker computes its prompt (engine/kv_connector.py)
                if not self.place(seq):
                    break
                self.waiting.popleft()
                self.let_go(seq, len(seq.prompt_ids))  # nobody computes here what the first step does not read
                seq.status = SeqStatus.WAITING_FOR_REMOTE_KV
                self.remote.append(seq)
                self.placed_remote.append(seq)
                continue
            if admitted_tokens >= budget or not self._admit(seq):
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

    def _room_for_draft(self, seq: Sequence) -> None:
        """Blocks for the draft's K/V, taken only while free: a draft is cut, never the cause of a preemption."""
        last = seq.num_computed + len(seq.draft)
        while seq.draft and len(seq.block_tables[0]) * self.block_size <= last:
            if self.blocks.num_free < self.groups:
                seq.draft = seq.draft[:len(seq.block_tables[0]) * self.block_size - seq.num_computed - 1]
                return
            self._grow(seq)

    def _grow(self, seq: Sequence) -> None:
        """One more block of every group: room for block_size more tokens."""
        for table, block in zip(seq.block_tables, self.blocks.allocate(self.groups)):
            table.append(block)

    def _admit(self, seq: Sequence) -> bool:
        """Reserve blocks for the whole prompt, reusing the prefix cache. False if they don't fit."""
        if not self.place(seq):
            return False
        seq.status = SeqStatus.RUNNING
        return True

    def place(self, seq: Sequence, cached: bool = True) -> bool:
        """Match the prefix cache (unless not `cached`) and allocate the rest (a block per group per block_size
        tokens); False if short."""
        tokens = seq.all_ids
        hashes = prefix_hashes(tokens, self.block_size)
        usable = self._usable_prefix(hashes, (len(tokens) - 1) // self.block_size) if cached else 0
        first = [self.layout.first_needed(g, usable * self.block_size) for g in range(self.groups)]
        keys = [group_key(hashes[i], g) for g in range(self.groups) for i in range(first[g], usable)]
        fresh_needed = self.groups * (self.blocks_needed(len(tokens)) - usable)
        if fresh_needed > self.blocks.num_free - self._cached_in_lru(keys):
            return False
        seq.block_tables, seq.live_from = [], first
        for g in range(self.groups):
            matched = self.blocks.match_prefix([group_key(h, g) for h in hashes[first[g]:usable]], count=g == 0)
            fresh = self.blocks.allocate(self.blocks_needed(len(tokens)) - usable)
            seq.block_tables.append([NULL_BLOCK] * first[g] + matched + fresh)
        seq.block_hashes = hashes[:usable]
        seq.num_computed = seq.num_cached = usable * self.block_size
        if seq.cached_prompt_tokens is None:  # a resumed sequence re-matches its own blocks: not a hit
            seq.cached_prompt_tokens = min(seq.num_cached, len(seq.prompt_ids))
        return True

    def _usable_prefix(self, hashes: list[bytes], limit: int) -> int:
        """Leading blocks whose K/V every group has cached: all of them for a global group, those of the window
        before the first uncached token for a windowed one."""
        if not self.blocks.enable_prefix_cache:
            return 0
        n = limit
        for g in range(self.groups):
            if not self.layout.window(g):
                n = min(n, self.blocks.peek_prefix([group_key(h, g) for h in hashes[:n]]))
        while n > 0 and not all(
            group_key(hashes[i], g) in self.blocks.cached
            for g in range(self.groups) if self.layout.window(g)
            for i in range(self.layout.first_needed(g, n * self.block_size), n)
        ):
            n -= 1
        return n

    def _cached_in_lru(self, keys: list[bytes]) -> int:
        """Matched blocks that currently count as free (they stop counting once referenced)."""
        return sum(1 for k in keys if self.blocks.ref[self.blocks.cached[k]] == 0)

    def let_go(self, seq: Sequence, num_tokens: int) -> None:
        """Release the windowed groups' blocks that the token after `num_tokens` no longer attends to."""
        for g, table in enumerate(seq.block_tables):
            first = self.layout.first_needed(g, num_tokens)
            if first > seq.live_from[g]:
                self.blocks.release(table[seq.live_from[g]:first])
                table[seq.live_from[g]:first] = [NULL_BLOCK] * (first - seq.live_from[g])
                seq.live_from[g] = first

    def prompt_blocks(self, seq: Sequence, first_block: int) -> list[list[int]]:
        """Per group, the blocks that hold the prompt's K/V from block `first_block` on and that the first decode
        step reads (a windowed group's from its window on). What a remote prefill writes; both sides compute the
        same lists from the prompt's length."""
        n = len(seq.prompt_ids)
        return [table[max(first_block, self.layout.first_needed(g, n)):] for g, table in enumerate(seq.block_tables)]

    def free(self, seq: Sequence, quarantine_from: int | None = None) -> list[int]:
        """Release every block the sequence holds; with `quarantine_from`, its blocks from that index on are
        quarantined instead (a remote writer may still touch them) and returned."""
        held: list[int] = []
        for g, table in enumerate(seq.block_tables):
            live = seq.live_from[g]
            cut = len(table) if quarantine_from is None else max(live, quarantine_from)
            self.blocks.release(table[live:cut])
            held += table[cut:]
        if held:
            self.blocks.quarantine(held)
        seq.block_tables, seq.live_from = [], []
        return held

    def _newest_running(self) -> Sequence:
        return max((s for s in self.running if s.status is SeqStatus.RUNNING), key=lambda s: s.arrival)

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it re-enters the queue front and recomputes its KV later."""
        self.free(seq)
        seq.block_hashes = []
        seq.draft = []
        seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        log.info("preempted %s (recompute %d tokens)", seq.request_id, seq.num_tokens)

    def commit(self, seq: Sequence, n: int) -> None:
        """`n` more tokens of `seq` now have K/V in the pool: name newly full blocks for reuse, let go of those that
        left a window."""
        seq.num_computed += n
        full = seq.num_computed // self.block_size
        if len(seq.block_hashes) < full:
            for i in range(len(seq.block_hashes), full):
                chunk = seq.tokens(i * self.block_size, (i + 1) * self.block_size)
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                h = block_hash(parent, chunk)
                seq.block_hashes.append(h)
                for g, table in enumerate(seq.block_tables):
                    if i >= seq.live_from[g]:
                        self.blocks.register(table[i], group_key(h, g))
        if self.layout.windows:
            self.let_go(seq, seq.num_computed)

    def landed(self, seq: Sequence) -> None:
        """`seq`'s prompt K/V came from another worker: it joins the batch with its prompt computed."""
        self.remote.remove(seq)
        self.commit(seq, len(seq.prompt_ids) - seq.num_computed)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def unplace(self, seq: Sequence, quarantine: bool) -> list[int]:
        """`seq` waits for remote K/V no more: its blocks go (the fresh ones quarantined, and returned, with
        `quarantine`) and it leaves the placed ones, for the queue's front or for good."""
        self.remote.remove(seq)
        held = self.free(seq, seq.num_cached // self.block_size if quarantine else None)
        seq.block_hashes, seq.num_computed = [], 0
        seq.status = SeqStatus.WAITING
        return held

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free(seq)
        seq.status = SeqStatus.FINISHED
