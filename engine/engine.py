"""LLMEngine: requests in, tokens and text out, one `step()` at a time.

The engine is single-threaded by design: actors call every method from one thread (the
model thread), so the event loop never waits on a forward pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.loader import LoadedModel
from engine.model import ForwardBatch, LlamaModel, PrefillSpan
from engine.sampling import Sampler, SamplingParams, TokenLogprob
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence
from kv.blocks import BlockPool
from kv.layout import KVLayout
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


DETOK_CONTEXT_TOKENS = 4  # tokens decoded before the new ones, for the decoder's context


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


def draw_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7_919) % (1 << 62)


class LLMEngine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig | None = None, pool: KVPool | None = None):
        self.cfg = cfg or EngineConfig()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        mc = loaded.config
        self.model = LlamaModel(mc, loaded.weights, self.cfg.device)
        self.layout = self.layout_for(loaded, self.cfg)
        self.pool = pool or KVPool(self.layout, self.cfg.num_blocks, self.cfg.device)
        if self.pool.layout != self.layout:
            raise ValueError(f"pool layout {self.pool.layout.describe()} differs from {self.layout.describe()}")
        self.blocks = BlockPool(self.pool.num_blocks, self.cfg.block_size, self.cfg.enable_prefix_cache)
        self.scheduler = Scheduler(self.blocks, self.cfg.max_batch, self.cfg.max_step_tokens)
        self.sampler = Sampler()
        self.max_model_len = min(self.cfg.max_model_len or mc.max_position, mc.max_position)
        # The most tokens one sequence's KV can ever occupy: a sequence that reaches it ends with
        # "length" (preempting itself could never be re-admitted, and would block the queue).
        self.pool_tokens = self.blocks.num_blocks * self.cfg.block_size
        self.seqs: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}
        # request id -> fn(layer): called per layer in the step that completes that request's prompt
        self.layer_hooks: dict[str, Callable[[int], None]] = {}
        self.device = torch.device(self.cfg.device)
        self.last_plan_size = 0

    @staticmethod
    def layout_for(loaded: LoadedModel, cfg: EngineConfig) -> KVLayout:
        mc = loaded.config
        return KVLayout(loaded.identity, cfg.dtype, cfg.block_size, mc.num_layers, mc.num_kv_heads, mc.head_dim)

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
        if self.scheduler.blocks_needed(len(prompt_ids) + 1) > self.blocks.num_blocks:
            raise ValueError(f"prompt needs more KV blocks than the pool has ({self.blocks.num_blocks})", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.loaded.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary", "prompt")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    hold_blocks: bool = False, resume_ids: list[int] | None = None, shown_chars: int = 0) -> Sequence:
        """Queue a request. With `hold_blocks` its KV stays allocated after it finishes, until
        `release_held` — a prefill worker keeps the blocks while it transfers them. `resume_ids`:
        output another engine generated already (a migrated request), resumed as after a preemption;
        `shown_chars` of its text were emitted there."""
        if request_id in self.seqs or request_id in self.held:
            raise ValueError(f"request {request_id} is already in the engine")
        self.check_request(prompt_ids, params)
        seq = Sequence(request_id, prompt_ids, params)
        seq.hold_blocks = hold_blocks
        if resume_ids:
            seq.output_ids = list(resume_ids)
            self._update_text(seq)
            seq.emitted_chars = min(shown_chars, len(seq.text))
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def release_held(self, request_id: str) -> None:
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.blocks.release(seq.block_table)
            seq.block_table = []

    # ------------------------------------------------------------ remote prefill (decode side)

    def reserve_remote(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> tuple[Sequence, list[int]] | None:
        """Blocks for a prompt another worker will prefill: prefix-cache hits plus fresh blocks.

        Returns the sequence and the fresh blocks (to be written from token `seq.num_cached` on),
        or None when the pool cannot hold the prompt now.
        """
        if request_id in self.seqs:
            raise ValueError(f"request {request_id} is already in the engine")
        self.check_request(prompt_ids, params)
        seq = Sequence(request_id, prompt_ids, params)
        fresh = self.scheduler.place(seq)
        if fresh is None:
            return None
        seq.status = SeqStatus.REMOTE
        self.seqs[request_id] = seq
        return seq, fresh

    def complete_remote(self, request_id: str, first_token: int, info: TokenLogprob | None) -> StepOutput:
        """The prompt's KV has landed: join the running batch with the first token."""
        seq = self.seqs[request_id]
        if seq.status is not SeqStatus.REMOTE:
            raise RuntimeError(f"{request_id} is not waiting for a remote prefill")
        self.scheduler.commit(seq, len(seq.prompt_ids) - seq.num_computed)
        seq.status = SeqStatus.RUNNING
        self.scheduler.running.append(seq)
        return self.append_token(seq, first_token, info)

    def abandon_remote(self, request_id: str, quarantine: bool) -> list[int]:
        """Drop a remote-prefill sequence. Blocks that a late write may still hit are quarantined
        (returned; free them with `release_quarantine`), the rest are released."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is not SeqStatus.REMOTE:
            return []
        del self.seqs[request_id]
        split = seq.num_cached // self.cfg.block_size
        shared, fresh = seq.block_table[:split], seq.block_table[split:]
        self.blocks.release(shared)
        if quarantine:
            self.blocks.quarantine(fresh)
        else:
            self.blocks.release(fresh)
        seq.block_table = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "abort"
        return fresh if quarantine else []

    def release_quarantine(self, blocks: list[int]) -> None:
        self.blocks.release_quarantine(blocks)

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        if seq.status is SeqStatus.REMOTE:  # left in place: abandon_remote still frees its blocks
            raise RuntimeError("abort a remote-prefill sequence through its owner (blocks may be quarantined)")
        del self.seqs[request_id]
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
        plan = self.scheduler.schedule()
        self.last_plan_size = len(plan)
        if not plan:
            return []
        batch, sampled = self._build_batch(plan)
        hooks = [self.layer_hooks[s.request_id] for s in sampled if s.request_id in self.layer_hooks]
        layer_done = (lambda li: [h(li) for h in hooks]) if hooks else None
        logits = self.model.forward(batch, self.pool, layer_done) if batch.tokens.numel() else None
        for seq, n in plan:
            self.scheduler.commit(seq, n)
        outputs: list[StepOutput] = []
        if sampled:
            for s in sampled:  # a seed fixes each draw by its index: same output on any worker, after preemption
                if s.generator is not None:
                    s.generator.manual_seed(draw_seed(s.params.seed, len(s.output_ids)))
            tokens, infos = self.sampler(
                logits, [s.params for s in sampled], [s.output_ids for s in sampled], [s.generator for s in sampled]
            )
            for seq, tok, info in zip(sampled, tokens, infos):
                outputs.append(self.append_token(seq, tok, info))
        return outputs

    def _build_batch(self, plan: list[tuple[Sequence, int]]) -> tuple[ForwardBatch, list[Sequence]]:
        bs = self.cfg.block_size
        prefill = [(s, n) for s, n in plan if n > 1]
        decode = [(s, n) for s, n in plan if n == 1]
        tokens: list[int] = []
        positions: list[int] = []
        spans: list[PrefillSpan] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        dev = self.device
        for seq, n in prefill + decode:
            start = seq.num_computed
            ids = seq.all_ids[start : start + n]
            if n > 1:
                spans.append(PrefillSpan(len(tokens), n, start + n, torch.tensor(seq.block_table, device=dev)))
            tokens += ids
            positions += range(start, start + n)
            if start + n == seq.num_tokens:
                logit_rows.append(len(tokens) - 1)
                sampled.append(seq)
        # Slot of every new token: (its block in the sequence's table, offset in that block).
        slot_blocks: list[int] = []
        for seq, n in prefill + decode:
            table = seq.block_table
            slot_blocks += [table[p // bs] for p in range(seq.num_computed, seq.num_computed + n)]
        pos_t = torch.tensor(positions, device=dev)
        tables = lens = None
        if decode:
            width = max(len(s.block_table) for s, _ in decode)
            tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s, _ in decode], device=dev)
            lens = torch.tensor([s.num_computed + 1 for s, _ in decode], device=dev)
        batch = ForwardBatch(
            tokens=torch.tensor(tokens, device=dev),
            positions=pos_t,
            slot_blocks=torch.tensor(slot_blocks, device=dev),
            slot_offsets=pos_t % bs,
            prefills=spans,
            decode_start=sum(n for _, n in prefill),
            decode_tables=tables,
            decode_lens=lens,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=dev),
        )
        return batch, sampled

    def append_token(self, seq: Sequence, tok: int, info: TokenLogprob | None = None) -> StepOutput:
        """Add a sampled token, apply the finish rules and return the new safe text."""
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        p = seq.params
        new_ids: list[int] = []
        if (tok in self.tokenizer.eog_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            seq.finish_reason = "stop"
        else:
            seq.output_ids.append(tok)
            new_ids.append(tok)
            if info is not None:
                seq.logprobs.append(info)
            self._update_text(seq)
            if seq.finish_reason is None and (
                len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= min(self.max_model_len, self.pool_tokens)
            ):
                seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.seqs.pop(seq.request_id, None)
            if seq.hold_blocks:
                self.scheduler.running.remove(seq)
                seq.status = SeqStatus.FINISHED
                self.held[seq.request_id] = seq
            else:
                self.scheduler.finish(seq)
        return self._emit(seq, new_ids, [info] if info is not None and new_ids else [])

    def _update_text(self, seq: Sequence) -> None:
        """Extend ``seq.text`` by the new tokens' text, decoding only a short window of tokens.

        Decoding ``ids[start:]`` and dropping the text of ``ids[start:read]`` keeps what a
        decoder does at a word's start (e.g. SentencePiece's leading space) out of the new
        text. A window ending in an incomplete UTF-8 character stays pending until the
        next token completes it.
        """
        ids = seq.output_ids
        searched_to = len(seq.detok_text)  # stop strings were looked for up to here (pending bytes may shrink)
        start = max(0, seq.detok_read - DETOK_CONTEXT_TOKENS)
        stable = self.tokenizer.decode(ids[start : seq.detok_read])
        window = self.tokenizer.decode(ids[start:])
        if window.startswith(stable):
            text = seq.detok_text + window[len(stable) :]
        else:  # a decoder that rewrites earlier text: decode the whole output
            text = self.tokenizer.decode(ids)
        if not text.endswith("\ufffd"):
            seq.detok_text, seq.detok_read = text, len(ids)
        stops = seq.params.stop
        if stops:
            longest = max(len(s) for s in stops)
            search_from = max(0, searched_to - longest)
            hits = [i for i in (text.find(s, search_from) for s in stops) if i >= 0]
            if hits:
                text = text[: min(hits)]
                seq.finish_reason = "stop"
        seq.text = text

    def _emit(self, seq: Sequence, new_ids: list[int], infos: list[TokenLogprob]) -> StepOutput:
        text = seq.text
        end = len(text)
        if seq.finish_reason is None:
            while end > seq.emitted_chars and text[end - 1] == "\ufffd":  # incomplete UTF-8 so far
                end -= 1
            for stop in seq.params.stop:  # hold back a tail that may grow into a stop string
                for k in range(min(len(stop) - 1, end - seq.emitted_chars), 0, -1):
                    if text[end - k : end] == stop[:k]:
                        end -= k
                        break
        delta = text[seq.emitted_chars : end] if end > seq.emitted_chars else ""
        seq.emitted_chars = max(seq.emitted_chars, end)
        return StepOutput(
            request_id=seq.request_id,
            token_ids=new_ids,
            text=delta,
            logprobs=infos,
            finish_reason=seq.finish_reason,
            prompt_tokens=len(seq.prompt_ids),
            cached_tokens=seq.cached_prompt_tokens or 0,
            completion_tokens=len(seq.output_ids),
        )

    # ------------------------------------------------------------ convenience

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Run prompts to completion (offline use, tests, `tandem generate`)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(f"gen-{id(self)}-{i}-{time.monotonic_ns()}", p, sp)
                for i, (p, sp) in enumerate(zip(prompts, plist))]
        while any(not s.finished for s in seqs):
            self.step()
        return seqs
