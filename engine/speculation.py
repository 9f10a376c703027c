"""Speculative decoding by prompt lookup: drafts come from the sequence's own text, no second model.

A decoding sequence whose last few tokens occurred earlier (in the prompt or in its output) drafts the
tokens that followed them there; one whose grammar forces the next tokens (a JSON key, a closing brace)
drafts those (grammar fast-forward). The engine computes the last token and the draft as one chunk, samples
every row as if it were decoding one token at a time (same params, same history, same per-position seed),
and keeps the drafts up to the first one that differs from what was sampled, plus that sampled token.
Because a row's token is drawn exactly as plain decoding would draw it, the output has the target's
distribution (for a one-token draft this is the standard accept/reject rule: the draft is kept with the
probability the target gives it), and a seeded or greedy request gives the same tokens with speculation
on or off. Rejected rows leave K/V past the sequence's end; the next step overwrites them.
"""

from __future__ import annotations

from collections.abc import Callable
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
    max_batch: int = 8  # drafts only while at most this many sequences decode
    # a step's fixed cost (weights streamed, the layers' launches, sampling) in rows' worth of compute, until
    # the engine's own steps have measured it (StepCost): 1-2 on a 2-core CPU, where a row of the int4 kernels
    # costs nearly its own weight pass, so a draft pays only where it is likely kept (bench.speculation)
    step_rows: float = 1.5

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculative mode must be one of {', '.join(MODES)}, got {self.mode!r}")


SEQ_DECAY = 0.8  # weight of a sequence's earlier verifications in its acceptance estimate
SEQ_PRIOR = 2.0  # pseudo-verifications a sequence's estimate starts from: the engine's, for that tail length
ENGINE_DECAY = 0.98  # the same across every sequence, per tail length
ENGINE_PRIOR = (4.0, 1.0)  # (kept, missed) before any draft: a long tail's continuation is usually right
COST_DECAY = 0.98  # weight of earlier steps in the fit of step time against rows
SIZE_DECAY = 0.8  # weight of earlier steps in a row count's own running mean


class StepCost:
    """Step time against rows, from the engine's own decode steps: a running mean per row count that has run, and
    elsewhere the straight line t = F + r rows fitted to every step (weighted least squares, recent steps weigh
    most). The line alone misjudged the packed int8 kernels, where 1-3 rows take about one weight pass and each
    row past 4 a row's compute: it priced a draft row at batch 4 at 0.8 tokens when it cost 1.0."""

    def __init__(self, default_rows: float):
        self.default_rows = default_rows
        self.sums = [0.0] * 5  # weight, x, y, xx, xy
        self.by_rows: dict[int, float] = {}  # rows -> running mean seconds

    def observe(self, rows: int, seconds: float) -> None:
        for i, v in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            self.sums[i] = COST_DECAY * self.sums[i] + v
        seen = self.by_rows.get(rows)
        self.by_rows[rows] = seconds if seen is None else SIZE_DECAY * seen + (1 - SIZE_DECAY) * seconds

    def _line(self) -> tuple[float, float] | None:
        """(F, r) of the fitted line, or None before steps of several sizes have run."""
        w, x, y, xx, xy = self.sums
        if w < 4 or xx / w - (x / w) ** 2 < 0.25:  # too few steps, or all of one size
            return None
        slope = (w * xy - x * y) / (w * xx - x * x)
        intercept = (y - slope * x) / w
        return (intercept, slope) if slope > 0 and intercept > 0 else None

    def step_rows(self) -> float:
        """F / r of the line: a step's fixed cost in rows (the default until it is fitted)."""
        line = self._line()
        return self.default_rows if line is None else min(max(line[0] / line[1], 0.25), 16.0)

    def relative(self, batch: int) -> Callable[[int], float]:
        """cost(k): a step of `batch` decoding sequences that each verify k draft tokens, against one without
        drafts (the line fitted once, for every k a draft decision weighs)."""
        line = self._line()
        if line is None:
            row = batch / (self.default_rows + batch)
            return lambda k: 1.0 + k * row

        def seconds(n: int) -> float:
            return self.by_rows.get(n, line[0] + line[1] * n)
        base = seconds(batch)
        return lambda k: max(seconds(batch * (1 + k)) / base, 1.0)


@dataclass
class DraftState:
    """A sequence's n-gram index and how often its draft tokens were kept lately."""

    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> position after its latest end
    indexed: int = 0  # n-grams ending before this position are in the index
    kept: float = 0.0  # draft tokens kept, decayed
    missed: float = 0.0  # drafts cut short, decayed
    tail: int = 0  # length of the tail the latest draft matched; 0: the grammar forced it


def draft_length(acceptance: float, cost: Callable[[int], float], most: int) -> int:
    """The draft length that gives the most tokens per unit of step cost: a draft of k tokens each kept with
    probability a (after the one before) yields (1 - a^(k+1)) / (1 - a) tokens for a step that costs cost(k) of one
    without drafts."""
    def rate(k: int) -> float:
        tokens = k + 1 if acceptance >= 1.0 else (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)
        return tokens / cost(k)
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
        self.cost = StepCost(cfg.step_rows)
        # per tail length (0: what a grammar forced), the engine's (kept, missed) draft tokens, decayed
        self.by_tail = {n: list(ENGINE_PRIOR) for n in (0, *range(cfg.min_ngram, cfg.max_ngram + 1))}
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # of those, kept

    @staticmethod
    def state(seq: Sequence) -> DraftState:
        if seq.spec is None:
            seq.spec = DraftState()
        return seq.spec

    def acceptance(self, state: DraftState, tail: int) -> float:
        """The chance that a draft token is kept when the one before it was: the sequence's recent looked-up
        drafts on top of the engine's for drafts from a tail of this length (a forced draft: the engine's)."""
        k, m = self.by_tail[tail]
        prior = (k + 1.0) / (k + m + 2.0)
        if not tail:
            return prior
        return (state.kept + SEQ_PRIOR * prior) / (state.kept + state.missed + SEQ_PRIOR)

    def draft(self, seq: Sequence, room: int, batch: int) -> list[int]:
        """What the grammar forces next, else the tokens that followed the latest earlier occurrence of the
        sequence's tail: as many as pay for their rows in a step of `batch` decoding sequences."""
        state = self.state(seq)
        room = min(room, self.cfg.max_draft)
        if room <= 0:
            return []
        if seq.grammar is not None:
            forced = seq.grammar.forced()[:room]
            if forced:
                return self._take(state, 0, forced, batch)
        ids = seq.all_ids
        end = len(ids) - 1  # the tail's own occurrence (ending at the last token) is not indexed yet
        for i in range(state.indexed, end):
            for n in range(self.cfg.min_ngram, self.cfg.max_ngram + 1):
                if i + 1 >= n:
                    state.index[tuple(ids[i + 1 - n:i + 1])] = i + 1
        state.indexed = max(state.indexed, end)
        for n in range(self.cfg.max_ngram, self.cfg.min_ngram - 1, -1):
            after = state.index.get(tuple(ids[len(ids) - n:])) if len(ids) >= n else None
            if after is not None:
                return self._take(state, n, ids[after:after + room], batch)
        return []

    def _take(self, state: DraftState, tail: int, candidates: list[int], batch: int) -> list[int]:
        """As many of the candidate tokens as pay for their rows in a step of `batch` decoding sequences."""
        want = draft_length(self.acceptance(state, tail), self.cost.relative(batch), len(candidates))
        if want <= 0:  # the sequence's estimate drifts back to the engine's, so it tries again later
            state.kept *= SEQ_DECAY
            state.missed *= SEQ_DECAY
            return []
        state.tail = tail
        return candidates[:want]

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a verification in the totals and in the acceptance estimates."""
        self.drafted += drafted
        self.accepted += accepted
        state = self.state(seq)
        missed = accepted < drafted
        if state.tail:
            state.kept = SEQ_DECAY * state.kept + accepted
            state.missed = SEQ_DECAY * state.missed + missed
        counts = self.by_tail[state.tail]
        counts[0] = ENGINE_DECAY * counts[0] + accepted
        counts[1] = ENGINE_DECAY * counts[1] + missed
