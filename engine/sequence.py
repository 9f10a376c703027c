"""A request inside the engine: its tokens, its KV blocks and its progress; what a step hands out for it."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.grammar import GrammarState
from engine.params import SamplingParams
from engine.sampling import TokenLogprob


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # placed; another worker writes its prompt's K/V (kv_connector)
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams):
        if not prompt_ids:
            raise ValueError("prompt is empty")
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.status = SeqStatus.WAITING
        # one block table per KV group (kv.layout): entries before live_from[g] left a sliding window and were
        # let go (they hold NULL_BLOCK); every table has a block for every block_size tokens placed
        self.block_tables: list[list[int]] = []
        self.live_from: list[int] = []
        self.draft: list[int] = []  # tokens proposed to follow this step's one (engine/speculation.py)
        self.spec = None  # the drafter's state (engine.speculation.DraftState), made at the first proposal
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks registered so far
        self.num_computed = 0  # tokens whose K/V sit in the pool
        self.num_cached = 0  # tokens found in the prefix cache at the latest placement
        self.cached_prompt_tokens: int | None = None  # prompt tokens the cache served at the first placement (usage)
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.detok: IncrementalDetokenizer | None = None  # set by the engine, which has the tokenizer
        self.grammar: GrammarState | None = None  # set by the engine when the output follows a grammar
        self.preemptions = 0
        self.remote = False  # its prompt's K/V comes from another worker (engine/kv_connector.py)
        # the whole prompt in one step, past the step budget (up to WHOLE_PREFILL_MAX_TOKENS): a prefill
        # worker streams its KV layer by layer while that step runs
        self.whole_prefill = False
        self.passed_over = 0  # steps in a row this unfinished prompt got nothing (engine/scheduler.py)
        self.compute_s = 0.0  # wall seconds of the engine steps it was in
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without joining the two whole lists."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        if start >= n:
            return self.output_ids[start - n : stop - n]
        return self.prompt_ids[start:] + self.output_ids[: stop - n]

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def text(self) -> str:
        """The detokenized output so far, cut before a stop string."""
        return self.detok.text if self.detok is not None else ""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}, {self.status.value}, {self.num_computed}/{self.num_tokens})"


@dataclass
class StepOutput:
    """What one step produced for one request: new tokens and the text that is safe to show."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    compute_s: float = 0.0  # wall seconds of the engine steps this sequence was in so far

    def then(self, later: StepOutput) -> StepOutput:
        """This output followed by a later one of the same step (kept draft tokens)."""
        return dataclasses.replace(later, token_ids=self.token_ids + later.token_ids, text=self.text + later.text,
                                   logprobs=self.logprobs + later.logprobs)
