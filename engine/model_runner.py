"""ModelRunner: one scheduler plan in, one forward pass, the sampled tokens out.

The one place that turns sequences into tensors. Per step it touches only what changed: each
decoding sequence owns a row of a persistent block-table tensor (rewritten when its blocks change,
extended when it gains one), so a decode step builds O(batch) values, never whole token histories
or block lists. Host-side staging buffers are allocated once and grow when a step is larger.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from engine.forward_batch import ForwardBatch, PrefillSpan
from engine.kv_connector import KVConnector
from engine.linear_paths import KERNELS
from engine.model import DecoderModel
from engine.sampling import Sampler, TokenLogprob, draw_seed
from engine.sequence import Sequence
from kv.pool import KVPool


class DecodeRows:
    """Block tables (of KV group `group`) of the decoding sequences, one persistent row each, kept compact
    (rows 0..B-1)."""

    def __init__(self, device: torch.device, group: int = 0, width: int = 64):
        self.device = device
        self.group = group
        self.table = torch.zeros(0, width, dtype=torch.long, device=device)
        self._views: dict[int, torch.Tensor] = {}  # n -> self.table[:n]
        self.row_of: dict[int, int] = {}  # id(sequence) -> row
        self.seqs: list[Sequence] = []  # row -> sequence
        # row -> (the block list written, entries written); the list itself, not its id, which a new list may reuse
        self.synced: list[tuple[list[int] | None, int]] = []

    def update(self, decoding: list[Sequence]) -> list[Sequence]:
        """Give every decoding sequence a row with its current blocks; return them in row order."""
        current = {id(s) for s in decoding}
        for seq in [s for s in self.seqs if id(s) not in current]:
            self._remove(seq)
        for seq in decoding:
            if id(seq) not in self.row_of:
                self._add(seq)
            self._sync(self.row_of[id(seq)], seq)
        return list(self.seqs)

    def rows(self, n: int) -> torch.Tensor:
        """The first n rows of the table (a view made once per n and table)."""
        view = self._views.get(n)
        if view is None:
            view = self._views[n] = self.table[:n]
        return view

    def _add(self, seq: Sequence) -> None:
        row = len(self.seqs)
        if row == self.table.shape[0]:
            grown = torch.zeros(max(8, 2 * row), self.table.shape[1], dtype=torch.long, device=self.device)
            grown[:row] = self.table
            self.table, self._views = grown, {}
        self.row_of[id(seq)] = row
        self.seqs.append(seq)
        self.synced.append((None, 0))

    def _remove(self, seq: Sequence) -> None:
        """Swap-remove: the last row moves into the freed one, so rows stay 0..B-1."""
        row = self.row_of.pop(id(seq))
        last = len(self.seqs) - 1
        if row != last:
            moved = self.seqs[last]
            self.table[row] = self.table[last]
            self.seqs[row], self.synced[row] = moved, self.synced[last]
            self.row_of[id(moved)] = row
        self.seqs.pop()
        self.synced.pop()

    def _sync(self, row: int, seq: Sequence) -> None:
        blocks = seq.block_tables[self.group]
        written_list, written = self.synced[row]
        if written_list is not blocks or written > len(blocks):  # a new placement (admission, resume): rewrite
            written = 0
        if written < len(blocks):
            if len(blocks) > self.table.shape[1]:
                wider = torch.zeros(self.table.shape[0], max(len(blocks), 2 * self.table.shape[1]),
                                    dtype=torch.long, device=self.device)
                wider[:, : self.table.shape[1]] = self.table
                self.table, self._views = wider, {}
            self.table[row, written:len(blocks)] = torch.tensor(blocks[written:], dtype=torch.long)
        self.synced[row] = (blocks, len(blocks))


class StepBuffers:
    """Grow-only staging for one step's per-token and per-row integers: a tensor per name, written through a
    numpy view of it, handed out as a view of its first n values made once per n. A step runs on caches the
    weights have just streamed through, where each torch operation costs ~5-50 µs: the steady state runs none.
    What `put` returns holds its values until the next `put` of that name (the next step's)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host: dict[str, tuple[torch.Tensor, np.ndarray, dict[int, torch.Tensor]]] = {}

    def put(self, name: str, values: list[int]) -> torch.Tensor:
        entry = self.host.get(name)
        if entry is None or len(values) > len(entry[1]):
            size = max(256, len(values), 2 * len(entry[1]) if entry else 0)
            tensor = torch.zeros(size, dtype=torch.long)
            entry = self.host[name] = (tensor, tensor.numpy(), {})
        tensor, host, views = entry
        n = len(values)
        host[:n] = values
        view = views.get(n)
        if view is None:
            view = views[n] = tensor[:n]
        return view.to(self.device) if self.device.type != "cpu" else view


class ModelRunner:
    def __init__(self, model: DecoderModel, pool: KVPool, block_size: int):
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.device = model.device
        self.groups = pool.layout.num_groups  # a block table per KV group (kv.layout)
        self.rows = [DecodeRows(self.device, g) for g in range(self.groups)]
        self.buffers = StepBuffers(self.device)
        self.sampler = Sampler()

    def run(self, plan: list[tuple[Sequence, int]], connector: KVConnector
            ) -> tuple[list[Sequence], list[list[int]], list[list[TokenLogprob | None]]]:
        """Compute `plan` (sequence, new tokens) and sample the sequences whose prompt is complete.

        The connector's `save_layer(layer, the sampled sequences)` runs after each layer where it asks for it
        (layer-wise KV streaming of the prompts this step completes). Returns the sampled sequences and, per sequence, its tokens and
        logprobs: one, or one per row of its draft (`seq.draft`) and the row before it, each drawn as plain
        decoding would draw it at that position had the draft before it been kept.
        """
        batch, sampled = self.prepare(plan)
        saving = connector.saves_layers and sampled
        layer_done = (lambda li: connector.save_layer(li, sampled)) if saving else None
        logits = self.model.forward(batch, self.pool, layer_done)
        if not sampled:
            return [], [], []
        params, outputs, generators, grammars, counts = [], [], [], [], []
        for s in sampled:
            rows = 1 + len(s.draft)
            counts.append(rows)
            params += [s.params] * rows
            grammars += [s.grammar] + [s.grammar and s.grammar.after(s.draft[:j]) for j in range(1, rows)]
            outputs += [s.output_ids] + [s.output_ids + s.draft[:j] for j in range(1, rows)]
            generators.append(s.generator)
            for j in range(1, rows):  # a seeded draw depends on its position only
                generators.append(None if s.generator is None else
                                  torch.Generator().manual_seed(draw_seed(s.params.seed, len(s.output_ids) + j)))
        tokens, infos = self.sampler(logits, params, outputs, generators, grammars)
        split_tokens, split_infos, at = [], [], 0
        for rows in counts:
            split_tokens.append(tokens[at:at + rows])
            split_infos.append(infos[at:at + rows])
            at += rows
        return sampled, split_tokens, split_infos

    def prepare(self, plan: list[tuple[Sequence, int]], every_row: bool = False) -> tuple[ForwardBatch, list[Sequence]]:
        """The plan as one flat batch: prefill chunks first (the long ones, computed by dequantize + MKL,
        leading), then one row per decoding sequence. With several KV groups, `ForwardBatch.groups` has the
        batch as each group's block tables see it. `every_row`: logits of every row, not only the sampled ones."""
        bs, dev, groups = self.block_size, self.device, range(self.groups)
        long_chunk = KERNELS.long_chunk()
        chunks = sorted(((s, n) for s, n in plan if not decodes(s, n)), key=lambda c: c[1] <= long_chunk)
        decode_seqs = [s for s, n in plan if decodes(s, n)]
        decoding = [rows.update(decode_seqs) for rows in self.rows][0]
        tokens: list[int] = []
        positions: list[int] = []
        slot_blocks: list[list[int]] = [[] for _ in groups]
        spans: list[list[PrefillSpan]] = [[] for _ in groups]
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        for seq, n in chunks:
            start = seq.num_computed
            index = [p // bs for p in range(start, start + n)]
            for g in groups:
                table = seq.block_tables[g]
                spans[g].append(PrefillSpan(len(tokens), n, start + n, torch.tensor(table, device=dev)))
                slot_blocks[g] += [table[i] for i in index]
            tokens += seq.tokens(start, start + n - len(seq.draft)) + seq.draft
            positions += range(start, start + n)
            if seq.draft:  # the last token and its draft: a row to sample at each
                logit_rows += range(len(tokens) - n, len(tokens))
                sampled.append(seq)
            elif start + n == seq.num_tokens:
                logit_rows.append(len(tokens) - 1)
                sampled.append(seq)
        decode_start = len(tokens)
        lens: list[int] = []
        for seq in decoding:
            p = seq.num_computed
            tokens.append(seq.token_at(p))
            positions.append(p)
            for g in groups:
                slot_blocks[g].append(seq.block_tables[g][p // bs])
            lens.append(p + 1)
            logit_rows.append(len(tokens) - 1)
            sampled.append(seq)
        batch = ForwardBatch(
            tokens=self.buffers.put("tokens", tokens),
            positions=self.buffers.put("positions", positions),
            slot_blocks=self.buffers.put("slot_blocks0", slot_blocks[0]),
            slot_offsets=self.buffers.put("slot_offsets", [p % bs for p in positions]),
            prefills=spans[0],
            decode_start=decode_start,
            decode_tables=self.rows[0].rows(len(decoding)) if decoding else None,
            decode_lens=self.buffers.put("decode_lens", lens) if decoding else None,
            logit_rows=torch.arange(len(tokens), device=dev) if every_row else self.buffers.put("logit_rows", logit_rows),
            decode_max_len=max(lens, default=0),
            dequant_rows=sum(n for _, n in chunks if n > long_chunk),
            decode_groups=length_groups(lens, bs),
        )
        if self.groups > 1:
            batch.groups = [batch] + [
                dataclasses.replace(batch, slot_blocks=self.buffers.put(f"slot_blocks{g}", slot_blocks[g]),
                                    prefills=spans[g],
                                    decode_tables=self.rows[g].rows(len(decoding)) if decoding else None)
                for g in groups if g]
        return batch, sampled


def decodes(seq: Sequence, n: int) -> bool:
    """Whether a plan entry is a decode row: its sequence's one token left to compute (a prompt's chunk of one
    token before its last, from a budget with one token left, is a chunk: sampled, it would end the prompt)."""
    return n == 1 and seq.num_tokens - seq.num_computed == 1


PADDING_SLACK = 1.25  # a decode group's longest context is at most this times its shortest (plus a block)
MAX_GROUPS = 4  # each group costs two gathers and an attention call per layer


def length_groups(lens: list[int], block_size: int) -> list[tuple[list[int] | None, int]] | None:
    """Decode rows grouped so that padding each group to its longest context wastes little.

    None when one group does (similar lengths, the common case): no regrouping cost at all.
    """
    if len(lens) < 2 or max(lens) <= PADDING_SLACK * min(lens) + block_size:
        return None
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = [[order[0]]]
    for i in order[1:]:
        if lens[i] > PADDING_SLACK * lens[groups[-1][0]] + block_size and len(groups) < MAX_GROUPS:
            groups.append([i])
        else:
            groups[-1].append(i)
    return [(g, max(lens[i] for i in g)) for g in groups]
