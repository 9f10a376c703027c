"""The flat token batch one forward pass of `engine.model.DecoderModel` takes: prefill chunks, then decode rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    start: int  # offset of the chunk in the flat token batch
    length: int  # new tokens in this chunk
    context: int  # tokens in the sequence after this chunk (cached + new)
    blocks: torch.Tensor  # block ids covering `context`


@dataclass
class ForwardBatch:
    """Flat token batch: prefill chunks first, then one-token decode rows."""

    tokens: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_blocks: torch.Tensor  # [N] block that receives each token's K/V
    slot_offsets: torch.Tensor  # [N] slot within that block
    prefills: list[PrefillSpan]
    decode_start: int  # first decode row in the flat batch
    decode_tables: torch.Tensor | None  # [B, max_blocks] block tables, padded (with any block) to the longest
    decode_lens: torch.Tensor | None  # [B] context length incl. the new token
    logit_rows: torch.Tensor  # rows of the flat batch whose logits are needed
    decode_max_len: int = 0  # max(decode_lens), known to the caller without a device sync (0: compute it)
    dequant_rows: int = 0  # leading rows (long prefill chunks) computed by dequantize + MKL (engine.quant)
    # decode rows grouped by context length: (rows of decode_tables, longest context); None: one group of all
    decode_groups: list[tuple[list[int] | None, int]] | None = None
    # per KV group (kv.layout), this batch with that group's slot blocks, spans and block tables; []: one group
    groups: list[ForwardBatch] = field(default_factory=list)

    def group(self, g: int) -> ForwardBatch:
        return self.groups[g] if self.groups else self
