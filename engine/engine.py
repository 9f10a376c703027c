"""LLMEngine: requests in, tokens and text out, one `step()` at a time.

Orchestration only: the scheduler plans a step, the model runner computes it and samples, and
each sequence's detokenizer turns its new tokens into text. The engine is single-threaded by
design: actors call every method from one thread (the model thread), so the event loop never
waits on a forward pass.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine import native
from engine.detokenizer import IncrementalDetokenizer
from engine.grammar import GrammarCompiler, GrammarState, check_grammar
from engine.kv_connector import DROP, LANDED, LOCAL, KVConnector
from engine.loader import LoadedModel
from engine.model import DecoderModel
from engine.model_files import KV_DTYPES
from engine.model_runner import ModelRunner, decodes
from engine.params import SamplingParams
from engine.sampling import TokenLogprob, draw_seed
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence, StepOutput
from engine.speculation import PromptLookup, SpeculationConfig, kept
from kv.blocks import BlockPool, OutOfBlocks
from kv.layout import DTYPES, KVLayout, plan_groups
from kv.pool import KVPool

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int = 1024
    max_batch: int = 32
    max_step_tokens: int = 512
    enable_prefix_cache: bool = True
    max_model_len: int | None = None  # default: the model's context length
    speculative: str = "ngram"  # engine/speculation.py: "ngram" (prompt lookup) or "off"
    kv_dtype: str = "auto"  # the KV pool's element type (KV_DTYPES; auto: see kv_dtype_for)


def kv_dtype_for(quantized: bool, cfg: EngineConfig) -> str:
    """The KV pool's element type: `cfg.kv_dtype`; with auto, float16 beside `quantized` weights (integer codes,
    `LoadedModel.quantized`) and float32 activations, else the activations' dtype.

    Why float16: a decode step reads every sequence's K/V, which at 16 streams of a few hundred tokens is 3x the
    default model's weights; float16 halves those bytes (decode attention 1.7x faster, the step ~1.1x, twice the
    sequences in a pool) at perplexity x1.0001 with the same greedy answers (docs/benchmarks.md). Float weights
    (`--quantization none`) keep a float32 cache: they are the reference the quality bench measures against."""
    if cfg.kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {cfg.kv_dtype!r}")
    if cfg.kv_dtype != "auto":
        return cfg.kv_dtype
    return "float16" if cfg.dtype == "float32" and quantized else cfg.dtype


class LLMEngine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig | None = None, pool: KVPool | None = None,
                 connector: KVConnector | None = None):
        self.cfg = cfg or EngineConfig()
        #: where the K/V of prompts another worker computes comes from (engine/kv_connector.py); set before the
        #: first remote request
        self.connector = connector or KVConnector()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        mc = loaded.config
        self.model = DecoderModel(mc, loaded.weights, self.cfg.device, DTYPES[self.cfg.dtype])
        if native.row_invariant() and (gaps := self.model.invariance_gaps()):
            raise ValueError(f"--kernels invariant cannot keep a request's rows invariant here: {'; '.join(gaps)} "
                             f"(it needs int4/Q8_0 weights on the CPU in float32, as the default model loads)")
        self.layout = self.layout_for(loaded, self.cfg)
        self.pool = pool or KVPool(self.layout, self.pool_blocks(self.layout, self.cfg.num_blocks), self.cfg.device)
        if self.pool.layout != self.layout:
            raise ValueError(f"pool layout {self.pool.layout.describe()} differs from {self.layout.describe()}")
        self.blocks = BlockPool(self.pool.num_blocks, self.cfg.block_size, self.cfg.enable_prefix_cache)
        self.scheduler = Scheduler(self.blocks, self.cfg.max_batch, self.cfg.max_step_tokens, self.layout)
        self.runner = ModelRunner(self.model, self.pool, self.cfg.block_size)
        spec = SpeculationConfig(self.cfg.speculative)
        self.drafter = PromptLookup(spec) if spec.mode != "off" else None
        self.max_model_len = min(self.cfg.max_model_len or mc.max_position, mc.max_position)
        # The most tokens one sequence's KV can ever occupy: a sequence that reaches it ends with
        # "length" (preempting itself could never be re-admitted, and would block the queue). A prompt holds
        # a block of every group until its prefill ends, so that is the bound.
        self.pool_tokens = self.token_blocks(self.blocks.num_blocks) * self.cfg.block_size
        self.max_seq_tokens = min(self.max_model_len, self.pool_tokens)  # a sequence ends "length" there
        self.seqs: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # ended, kept with their blocks while the connector sends their K/V
        self.quarantined: dict[str, list[int]] = {}  # connector key -> blocks a late remote write may still hit
        self.device = torch.device(self.cfg.device)
        self.last_plan_size = 0
        self._grammars: GrammarCompiler | None = None  # built at the first grammar (it indexes the vocabulary)

    @staticmethod
    def layout_for(loaded: LoadedModel, cfg: EngineConfig) -> KVLayout:
        mc = loaded.config
        groups, windows = plan_groups([mc.window(li) for li in range(mc.num_layers)])
        return KVLayout(loaded.identity, kv_dtype_for(loaded.quantized, cfg), cfg.block_size, mc.num_layers, mc.num_kv_heads, mc.head_dim,
                        weights=loaded.quantization, groups=groups, windows=windows)

    @staticmethod
    def pool_blocks(layout: KVLayout, num_blocks: int) -> int:
        """The pool's blocks for `num_blocks` blocks of every layer (the memory `--num-blocks` names)."""
        return num_blocks * layout.num_groups

    def token_blocks(self, blocks: int) -> int:
        """Pool blocks counted as blocks of every layer (block_size tokens each): what capacity reports use."""
        return blocks // self.layout.num_groups

    # ------------------------------------------------------------ requests

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError(message, param) for a request this engine can never serve."""
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt is empty", "prompt")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length of {self.max_model_len} tokens",
                "max_tokens",
            )
        capacity = self.token_blocks(self.blocks.num_blocks)
        if self.scheduler.blocks_needed(len(prompt_ids) + 1) > capacity:
            raise ValueError(f"prompt needs more KV blocks than the pool has ({capacity})", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.loaded.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary", "prompt")
        if params.grammar is not None:
            check_grammar(params.grammar)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    resume_ids: list[int] | None = None, shown_chars: int = 0, whole_prefill: bool = False,
                    remote: bool = False) -> Sequence:
        """Queue a request. `whole_prefill` computes the prompt in one step (past the step budget), so a layer-wise
        transfer (the connector's `save_layer`) overlaps all of it. `resume_ids`:
        output another engine generated already (a migrated request), resumed as after a preemption;
        `shown_chars` of its text were emitted there. `remote`: another worker computes the prompt's K/V into
        the blocks placed for it, through `self.connector` (engine/kv_connector.py)."""
        if request_id in self.seqs or request_id in self.held:
            raise ValueError(f"request {request_id} is already in the engine")
        self.check_request(prompt_ids, params)
        seq = self._new_sequence(request_id, prompt_ids, params)
        seq.whole_prefill = whole_prefill
        seq.remote = remote and not resume_ids
        if resume_ids:
            if seq.grammar is not None and not seq.grammar.accept_all(list(resume_ids)):
                raise ValueError(f"the resumed tokens do not follow the request's grammar: {seq.grammar.error}",
                                 "resume_ids")
            seq.output_ids = list(resume_ids)
            seq.detok.resume(seq.output_ids, shown_chars)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _new_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        seq = Sequence(request_id, prompt_ids, params)
        seq.detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        if params.grammar is not None:
            seq.grammar = self._grammar(params)
        return seq

    def _grammar(self, params: SamplingParams) -> GrammarState:
        if self._grammars is None:
            t0 = time.perf_counter()
            self._grammars = GrammarCompiler(self.tokenizer.tok.to_str(), self.loaded.config.vocab_size,
                                             sorted(self.tokenizer.eog_ids))
            log.info("grammar tokenizer index built in %.2fs", time.perf_counter() - t0)
        return self._grammars.compile(params.grammar)

    def prompt_blocks(self, request_id: str, first_block: int) -> list[list[int]]:
        """Per group, a sequence's blocks that a remote prefill writes from block `first_block` on
        (`Scheduler.prompt_blocks`)."""
        seq = self.seqs.get(request_id) or self.held[request_id]
        return self.scheduler.prompt_blocks(seq, first_block)

    # ------------------------------------------------------------ prompts computed elsewhere (kv_connector)

    def _remote_results(self) -> list[StepOutput]:
        """Apply what the connector reports (once a step, before planning): landed prompts join the batch with their
        first token; the others are placed again, prefilled here, or dropped; released quarantines are free."""
        results, released = self.connector.finished()
        for key in released:
            self.blocks.release_quarantine(self.quarantined.pop(key, []))
            if (seq := self.held.pop(key, None)) is not None:
                self.scheduler.free(seq)
        outputs = []
        for r in results:
            seq = self.seqs.get(r.request_id)
            if seq is None or seq.status is not SeqStatus.WAITING_FOR_REMOTE_KV:
                continue  # aborted meanwhile: abort ended its placement
            if r.outcome == LANDED:
                self.scheduler.landed(seq)
                outputs.append(self.append_token(seq, r.first_token, r.info))
                continue
            self._unplace(seq)
            if r.outcome == DROP:
                del self.seqs[seq.request_id]
                seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
                continue
            seq.remote = r.outcome != LOCAL
            self.scheduler.waiting.appendleft(seq)  # it was admitted before anything queued behind it
        return outputs

    def _start_placed(self) -> None:
        """Hand the prompts this step's plan placed for remote K/V to the connector: their writers may start."""
        for seq in self.scheduler.placed_remote:
            self.connector.after_allocation(seq, [b for group in self.scheduler.prompt_blocks(
                seq, seq.num_cached // self.cfg.block_size) for b in group])

    def _unplace(self, seq: Sequence) -> None:
        """End `seq`'s placement without its K/V: its fresh blocks quarantined under the connector's key (a late
        write may still hit them), or free."""
        key = self.connector.placement_ended(seq)
        held = self.scheduler.unplace(seq, quarantine=bool(key))
        if held:
            self.quarantined.setdefault(key, []).extend(held)

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        del self.seqs[request_id]
        if seq.status is SeqStatus.WAITING_FOR_REMOTE_KV:
            self._unplace(seq)
            seq.status = SeqStatus.FINISHED
        else:
            self.scheduler.finish(seq)
        seq.finish_reason = seq.finish_reason or "abort"
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------ stepping

    def step(self) -> list[StepOutput]:
        landed = self._remote_results()
        self._draft()
        plan = self.scheduler.schedule()
        self.last_plan_size = len(plan)
        self._start_placed()
        if not plan:
            return landed
        for seq, _ in plan:  # a seed fixes each draw by its index: same output on any worker, after preemption
            if seq.generator is not None:
                seq.generator.manual_seed(draw_seed(seq.params.seed, len(seq.output_ids)))
        t0 = time.perf_counter()
        sampled, tokens, infos = self.runner.run(plan, self.connector)
        dt = time.perf_counter() - t0
        if self.drafter is not None and all(decodes(s, n) or s.draft for s, n in plan):  # decode rows only
            self.drafter.cost.observe(sum(n for _, n in plan), dt)
        for seq, n in plan:
            if not seq.draft:
                self.scheduler.commit(seq, n)
            seq.compute_s += dt
        return landed + [self._verify(seq, toks, infos) if seq.draft else self.append_token(seq, toks[0], infos[0])
                         for seq, toks, infos in zip(sampled, tokens, infos)]

    def _draft(self) -> None:
        """Drafts for the decoding sequences, while there are few enough that verifying them pays."""
        if self.drafter is None:
            return
        decoding = [s for s in self.scheduler.running
                    if s.status is SeqStatus.RUNNING and s.num_tokens - s.num_computed == 1]
        if not decoding or len(decoding) > self.drafter.cfg.max_batch:
            return
        for seq in decoding:
            room = min(seq.params.max_tokens - len(seq.output_ids) - 1, self.max_seq_tokens - seq.num_tokens)
            seq.draft = self.drafter.draft(seq, room, len(decoding))

    def _verify(self, seq: Sequence, tokens: list[int], infos: list[TokenLogprob | None]) -> StepOutput:
        """Keep the draft up to its first token that differs from the one sampled at its row, then that sampled
        token; only the kept tokens' K/V is committed (what lies past it is overwritten by later steps)."""
        draft, seq.draft = seq.draft, []
        n = kept(draft, tokens)
        self.scheduler.commit(seq, 1)
        out: StepOutput | None = None
        for i in range(n + 1):
            step = self.append_token(seq, tokens[i], infos[i])
            out = step if out is None else out.then(step)
            if seq.finish_reason is not None:
                break
            if i < n:
                self.scheduler.commit(seq, 1)
        self.drafter.verified(seq, len(draft), n)
        return out

    def append_token(self, seq: Sequence, tok: int, info: TokenLogprob | None = None) -> StepOutput:
        """Add a sampled token, apply the finish rules and return the new safe text."""
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        p = seq.params
        new_ids: list[int] = []
        if (tok in self.tokenizer.eog_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            seq.finish_reason = "stop"
            text = seq.detok.flush()
        else:
            seq.output_ids.append(tok)
            new_ids.append(tok)
            if info is not None:
                seq.logprobs.append(info)
            grammar_done = seq.grammar is not None and self._advance_grammar(seq, tok)
            at_length = len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_seq_tokens
            text = seq.detok.add(seq.output_ids, final=at_length or grammar_done)
            if seq.detok.stopped or grammar_done:
                seq.finish_reason = "stop"
            elif at_length:
                seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.seqs.pop(seq.request_id, None)
            if self.connector.request_finished(seq):
                self.scheduler.running.remove(seq)
                seq.status = SeqStatus.FINISHED
                self.held[seq.request_id] = seq
            else:
                self.scheduler.finish(seq)
        return StepOutput(
            request_id=seq.request_id,
            token_ids=new_ids,
            text=text,
            logprobs=[info] if info is not None and new_ids else [],
            finish_reason=seq.finish_reason,
            prompt_tokens=len(seq.prompt_ids),
            cached_tokens=seq.cached_prompt_tokens or 0,
            completion_tokens=len(seq.output_ids),
            compute_s=seq.compute_s,
        )

    @staticmethod
    def _advance_grammar(seq: Sequence, tok: int) -> bool:
        """Advance the sequence's grammar by ``tok``; True when the output is complete (only an end can follow).

        The mask lets through only allowed tokens, so a refusal means a bug: the sequence ends there
        rather than sampling from a matcher in error."""
        if not seq.grammar.accept(tok):
            log.error("request %s: token %d broke its grammar (%s); ending it", seq.request_id, tok, seq.grammar.error)
            return True
        return seq.grammar.finished

    # ------------------------------------------------------------ convenience

    def prompt_logits(self, ids: list[int], cuts: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
        """Float32 logits at every position of `ids`, computed piece by piece between the `cuts` (each piece reads
        the earlier ones' K/V from the pool; a one-token piece is a decode row): perplexity, reference checks."""
        seq = Sequence(f"logits-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=1))
        if not self.scheduler.place(seq, cached=False):
            raise OutOfBlocks(f"{len(ids)} tokens do not fit in the KV pool now")
        try:
            bounds = [0, *cuts, len(ids)]
            out = []
            for start, stop in zip(bounds, bounds[1:]):
                seq.num_computed = start
                batch, _ = self.runner.prepare([(seq, stop - start)], every_row=True)
                out.append(self.model.forward(batch, self.pool))
                self.scheduler.let_go(seq, stop)  # as serving does: later pieces must not need what left a window
            return torch.cat(out)
        finally:
            self.runner.prepare([])  # its decode rows forget the sequence
            self.scheduler.free(seq)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Run prompts to completion (offline use, tests, `tandem generate`)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(f"gen-{id(self)}-{i}-{time.monotonic_ns()}", p, sp)
                for i, (p, sp) in enumerate(zip(prompts, plist))]
        while any(not s.finished for s in seqs):
            self.step()
        return seqs
