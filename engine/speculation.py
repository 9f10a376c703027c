"""Speculative decoding by prompt lookup: drafts come from the sequence's own text, no second model.

A decoding sequence whose last few tokens occurred earlier (in the prompt or in its output) drafts the
tokens that followed them there. The engine computes the last token and the draft as one chunk, samples
every row as if it were decoding one token at a time (same params, same history, same per-position seed),
and keeps the drafts up to the first one that differs from what was sampled, plus that sampled token.
Because a row's token is drawn exactly as plain decoding would draw it, the output has the target's
distribution (for a one-token draft this is the standard accept/reject rule: the draft is kept with the
probability the target gives it), and a seeded or greedy request gives the same tokens with speculation
on or off. Rejected rows leave K/V past the sequence's end; the next step overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the gateway reads MODES (settings) without loading torch
    from engine.sequence import Sequence

MODES = ("ngram", "off")


@dataclass
class SpeculationConfig:
    mode: str = "ngram"
    max_ngram: int = 4  # the longest tail looked up first
    min_ngram: int = 2  # shorter tails than this find too many poor matches
    max_draft: int = 8
    # a step's fixed cost (weights streamed once, the layers' launches, sampling) in rows' worth of compute: on
    # this 2-core CPU a row of the int4 kernels costs nearly its own weight pass, so this is small and a draft
    # pays only where it is likely kept (bench.speculation measures it)
    step_rows: float = 1.2
    max_batch: int = 8  # drafts only while at most this many sequences decode

    def row_cost(self, batch: int) -> float:
        """A draft row's cost relative to a token of plain decoding in a batch of `batch`: r / ((F + r B) / B)."""
        return batch / (self.step_rows + batch)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculative mode must be one of {', '.join(MODES)}, got {self.mode!r}")


DECAY = 0.8  # weight of the previous verifications in a sequence's acceptance estimate


@dataclass
class DraftState:
    """A sequence's n-gram index and how often its draft tokens were kept lately."""

    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> position after its latest end
    indexed: int = 0  # n-grams ending before this position are in the index
    kept: float = 0.0  # draft tokens kept, decayed
    missed: float = 0.0  # drafts cut short, decayed

    def acceptance(self) -> float:
        """The chance that a draft token is kept when the one before it was (Laplace's rule over recent drafts)."""
        return (self.kept + 1.0) / (self.kept + self.missed + 2.0)


def draft_length(acceptance: float, row_cost: float, most: int) -> int:
    """The draft length that gives the most tokens per unit of step cost: a draft of k tokens each kept with
    probability a (after the one before) yields (1 - a^(k+1)) / (1 - a) tokens for 1 + row_cost k."""
    def rate(k: int) -> float:
        tokens = k + 1 if acceptance >= 1.0 else (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)
        return tokens / (1.0 + row_cost * k)
    return max(range(most + 1), key=rate)


def kept(draft: list[int], sampled: list[int]) -> int:
    """How many draft tokens stand: those up to the first that differs from the token sampled at the row before
    it (`sampled[j]` was drawn where `draft[j]` was proposed)."""
    n = 0
    while n < len(draft) and draft[n] == sampled[n]:
        n += 1
    return n


class PromptLookup:
    def __init__(self, cfg: SpeculationConfig):
        self.cfg = cfg
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # of those, kept

    @staticmethod
    def state(seq: Sequence) -> DraftState:
        if seq.spec is None:
            seq.spec = DraftState()
        return seq.spec

    def propose(self, seq: Sequence, room: int, row_cost: float) -> list[int]:
        """Up to `room` tokens that followed the latest earlier occurrence of the sequence's tail, as many as
        pay for their rows at `row_cost` (`SpeculationConfig.row_cost`)."""
        state = self.state(seq)
        ids = seq.all_ids
        end = len(ids) - 1  # the tail's own occurrence (ending at the last token) is not indexed yet
        for i in range(state.indexed, end):
            for n in range(self.cfg.min_ngram, self.cfg.max_ngram + 1):
                if i + 1 >= n:
                    state.index[tuple(ids[i + 1 - n:i + 1])] = i + 1
        state.indexed = max(state.indexed, end)
        want = draft_length(state.acceptance(), row_cost, min(room, self.cfg.max_draft))
        if want <= 0:  # the estimate drifts back to even odds, so a sequence whose text turns repetitive tries again
            state.kept *= DECAY
            state.missed *= DECAY
            return []
        for n in range(self.cfg.max_ngram, self.cfg.min_ngram - 1, -1):
            if len(ids) < n:
                continue
            after = state.index.get(tuple(ids[len(ids) - n:]))
            if after is not None:
                return ids[after:after + want]
        return []

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a verification in the totals and in the sequence's acceptance estimate."""
        self.drafted += drafted
        self.accepted += accepted
        state = self.state(seq)
        state.kept = DECAY * state.kept + accepted
        state.missed = DECAY * state.missed + (accepted < drafted)
