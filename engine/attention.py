"""Attention through the paged KV pool: long prompt chunks with engine.native's bfloat16 kernel or torch's SDPA,
short chunks and decode rows with engine.native's paged attention on a CPU,
and batched decode attention grouped by context length."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import native
from engine.forward_batch import ForwardBatch, PrefillSpan
from engine.linear_paths import KERNELS


def span_attention(q, k, v, kc, vc, span: PrefillSpan, out: torch.Tensor, scale: float, window: int = 0) -> None:
    """One prompt chunk's causal attention ([rows, heads, d] views of the flat batch) with torch's SDPA,
    into `out`: over the chunk itself, or over its cached context gathered from the pool; with `window`, each
    row over its last `window` tokens only."""
    sl = slice(span.start, span.start + span.length)
    qs = q[sl].transpose(0, 1).unsqueeze(0)
    past = span.context - span.length
    lo = 0  # the first token any row of the chunk sees: past the window of its first row, from its block on
    if span.context == span.length:  # nothing cached: attend to the chunk itself
        ks, vs = k[sl], v[sl]
        if kc.dtype != q.dtype:  # as the pool holds it (rounded), so a whole prompt computes what its chunks do
            ks, vs = ks.to(kc.dtype).to(q.dtype), vs.to(vc.dtype).to(q.dtype)
    else:
        bs = kc.shape[1]
        first = max(0, past + 1 - window) // bs if window else 0
        blk = span.blocks[first: (span.context + bs - 1) // bs]
        lo = first * bs
        ks = kc[blk].flatten(0, 1)[: span.context - lo].to(q.dtype)
        vs = vc[blk].flatten(0, 1)[: span.context - lo].to(q.dtype)
    mask, causal = None, True
    if past or (window and span.context > window):
        qi = torch.arange(span.length, device=q.device).unsqueeze(1) + past
        kj = torch.arange(lo, span.context, device=q.device).unsqueeze(0)
        mask, causal = kj <= qi, False
        if window:
            mask &= kj > qi - window
    o = F.scaled_dot_product_attention(
        qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=causal, enable_gqa=True, scale=scale,
    )
    out[sl] = o.squeeze(0).transpose(0, 1)


_ROWS: dict[int, torch.Tensor] = {}


def row_numbers(n: int) -> torch.Tensor:
    """0..n-1 as int64, made once per n (a decode step's row table without a torch call). Read-only."""
    rows = _ROWS.get(n)
    if rows is None:
        rows = _ROWS[n] = torch.arange(n)
    return rows


class PagedAttention:
    """Attention in one C call per layer (`engine.native`) for the decode rows and the rows of prompt chunks
    of up to `KERNELS.kernel_max_chunk` tokens: row r reads the first lens[r] tokens of its sequence straight
    from the pool through its block table (no gather, padding or mask), and a short chunk's rows run the
    same code as decode rows, so such a token computes the same either way (as it does in the linear
    layers). Longer chunks are GEMM-shaped: on an AVX-512 build `native.chunk_attention`, flash-attention style
    (float32: 1.6-3.4x torch's SDPA on an Ice Lake Xeon; with `bf16`, a quantized model whose long chunks multiply
    on bfloat16 panels too, on kernel path avx512_bf16: bfloat16 operands, 2.5-3x SDPA on Zen 4), elsewhere
    torch's SDPA (`span_attention`), many times faster there than one query row at a time."""

    def __init__(self, batch: ForwardBatch, heads: int, scale: float, bf16: bool = False):
        self.heads, self.scale, self.bf16 = heads, scale, bf16
        long_chunk = KERNELS.long_chunk()
        self.long_spans = [s for s in batch.prefills if s.length > long_chunk]
        short = [s for s in batch.prefills if s.length <= long_chunk]
        decode_rows = batch.decode_tables.shape[0] if batch.decode_tables is not None else 0
        n = sum(s.length for s in short) + decode_rows
        self.rows: torch.Tensor | None = None  # rows of the flat batch this call computes; None: all of them
        if not short:
            self.tables, self.lens = batch.decode_tables, batch.decode_lens
            self.row_table = row_numbers(decode_rows)
        else:
            width = max([len(s.blocks) for s in short] + ([batch.decode_tables.shape[1]] if decode_rows else []))
            self.tables = torch.zeros(len(short) + decode_rows, width, dtype=torch.long)
            self.row_table = torch.empty(n, dtype=torch.long)
            self.lens = torch.empty(n, dtype=torch.long)
            at = 0
            for i, s in enumerate(short):
                self.tables[i, : len(s.blocks)] = s.blocks
                self.row_table[at:at + s.length] = i
                torch.arange(s.context - s.length + 1, s.context + 1, out=self.lens[at:at + s.length])
                at += s.length
            if decode_rows:
                self.tables[len(short):, : batch.decode_tables.shape[1]] = batch.decode_tables
                torch.arange(len(short), len(short) + decode_rows, out=self.row_table[at:])
                self.lens[at:] = batch.decode_lens
        if self.long_spans and n:
            self.rows = torch.cat([torch.arange(s.start, s.start + s.length) for s in short]
                                  + [torch.arange(batch.decode_start, batch.decode_start + decode_rows)])

    def __call__(self, qkv: torch.Tensor, q_size: int, kv_heads: int, kc: torch.Tensor,
                 vc: torch.Tensor, window: int = 0) -> torch.Tensor:
        """Attention output [rows, q_size] of the batch's rows, from `qkv` after RoPE (K/V in the pool)."""
        q = qkv[:, :q_size]
        if not self.long_spans:
            return self._paged(q, kc, vc, window)
        n, d = qkv.shape[0], q_size // self.heads
        out = torch.empty(n, q_size, dtype=qkv.dtype)
        qh, kh = q.view(n, self.heads, d), qkv[:, q_size:q_size + kv_heads * d].view(n, kv_heads, d)
        vh = qkv[:, q_size + kv_heads * d:].view(n, kv_heads, d)
        in_c = native.has_chunk_attention() and d % 64 == 0 and d <= 256
        in_bf16 = self.bf16 and native.kernel_path() in native.bf16_attention_paths()
        for span in self.long_spans:
            if in_c:
                native.chunk_attention(qkv, span.start, span.length, span.context, span.blocks, kc, vc, self.heads,
                                       self.scale, window, out, in_bf16)
            else:
                span_attention(qh, kh, vh, kc, vc, span, out.view(n, self.heads, d), self.scale, window)
        if self.rows is not None:
            out.index_copy_(0, self.rows, self._paged(q.index_select(0, self.rows), kc, vc, window))
        return out

    def _paged(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, window: int) -> torch.Tensor:
        return native.paged_attention(q, kc, vc, self.tables, self.row_table, self.lens, self.heads, self.scale,
                                      window)


class DecodeAttention:
    """Batched attention of one new token per sequence over its paged context.

    Sequences are grouped by context length (`ForwardBatch.decode_groups`), so a group's block
    tables are padded only to its own longest context, never to the batch's. Each group's gather
    index and length mask are built once per forward pass and serve every layer (a sliding-window
    layer's mask once per window); a group of one sequence needs no mask (its context is sliced).
    """

    def __init__(self, batch: ForwardBatch, block_size: int, scale: float):
        groups = batch.decode_groups or [(None, batch.decode_max_len or int(batch.decode_lens.max()))]
        self.groups = [_DecodeGroup(batch, rows, longest, block_size, scale) for rows, longest in groups]

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, window: int = 0) -> torch.Tensor:
        if len(self.groups) == 1 and self.groups[0].rows is None:
            return self.groups[0](q, kc, vc, window)
        out = torch.empty_like(q)
        for g in self.groups:
            out.index_copy_(0, g.rows, g(q.index_select(0, g.rows), kc, vc, window))
        return out


class _DecodeGroup:
    def __init__(self, batch: ForwardBatch, rows: list[int] | None, longest: int, block_size: int, scale: float):
        tables, lens = batch.decode_tables, batch.decode_lens
        self.rows = None
        if rows is not None:
            self.rows = torch.tensor(rows, device=tables.device)
            tables, lens = tables.index_select(0, self.rows), lens.index_select(0, self.rows)
        nblk = (longest + block_size - 1) // block_size
        self.bsz, self.scale, self.lens = tables.shape[0], scale, lens
        self.index = tables[:, :nblk].reshape(-1)
        self.width = nblk * block_size
        self.single = longest if self.bsz == 1 else 0
        self.masks: dict[int, torch.Tensor | None] = {}

    def mask(self, window: int) -> torch.Tensor | None:
        """[bsz, 1, 1, width]: which pool slots each row attends to (None: a single row, sliced instead)."""
        if window not in self.masks:
            pos = torch.arange(self.width, device=self.lens.device).unsqueeze(0)
            lens = self.lens.unsqueeze(1)
            seen = pos < lens
            if window:
                seen &= pos >= lens - window
            self.masks[window] = None if self.single else seen.view(self.bsz, 1, 1, self.width)
        return self.masks[window]

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, window: int = 0) -> torch.Tensor:
        shape = (self.bsz, self.width, *kc.shape[2:])
        ks = kc.index_select(0, self.index).view(shape)  # index_select: 3-4x faster than kc[tables] here
        vs = vc.index_select(0, self.index).view(shape)
        if self.single:
            first = max(0, self.single - window) if window else 0
            ks, vs = ks[:, first: self.single], vs[:, first: self.single]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), ks.transpose(1, 2).to(q.dtype), vs.transpose(1, 2).to(q.dtype),
            attn_mask=self.mask(window), enable_gqa=True, scale=self.scale,
        )
        return o.squeeze(2)
