"""Llama-family decoder in plain PyTorch, attending through a paged, block-major KV pool.

One forward pass serves a mixed batch: any number of sequences each contributing a chunk of
new tokens. Linear layers run once over all tokens; attention runs per sequence for chunks
longer than one token (prefill) and batched for one-token chunks (decode).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ROPE_SCALING_KEYS, ModelConfig, rope_scaling_type
from kv.pool import KVPool


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
    decode_tables: torch.Tensor | None  # [B, max_blocks] padded block tables
    decode_lens: torch.Tensor | None  # [B] context length incl. the new token
    logit_rows: torch.Tensor  # rows of the flat batch whose logits are needed


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with llama3-style scaling when the config asks for it."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    sc = cfg.rope_scaling or {}
    kind = rope_scaling_type(sc)
    if kind == "llama3":
        factor = sc["factor"]
        low, high = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        orig = sc["original_max_position_embeddings"]
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "factors":  # GGUF's rope_freqs tensor: per-frequency divisors
        inv = inv / torch.tensor(sc["factors"], dtype=torch.float64)
    elif kind != "default":  # the loader refuses these first; guard for configs built by hand
        supported = ", ".join(ROPE_SCALING_KEYS)
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {supported})")
    return inv.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T, shaped for MKL on the CPU.

    For up to 128 rows (decode batches, short chunks) MKL is much faster computed as (w @ x.T).T,
    and a single row is fastest padded to two: its matrix-vector path streams the weights at less
    than half the bandwidth of the two-column product (whole model: 45 ms vs 19 ms here).
    """
    n = x.shape[0]
    if x.device.type != "cpu" or n > 128:
        return x @ w.T
    if n == 1:
        return torch.mm(w, torch.cat([x, x]).T)[:, :1].T.contiguous()
    return torch.mm(w, x.T).T.contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (rotate_half) RoPE on [N, heads, head_dim] with cos/sin [N, 1, head_dim/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaModel:
    """Weights are a dict of tensors with fused QKV and gate/up projections (see engine.weights)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.w = {k: v.to(self.device) for k, v in weights.items()}
        self.dtype = self.w["embed"].dtype
        self.lm_head = self.w.get("lm_head", self.w["embed"])
        self.layers = [
            {
                name: self.w[f"layers.{i}.{name}"]
                for name in ("attn_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down")
            }
            for i in range(cfg.num_layers)
        ]
        inv = rope_frequencies(cfg).to(self.device)
        t = torch.arange(cfg.max_position, device=self.device, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        self.cos = freqs.cos().to(self.dtype)
        self.sin = freqs.sin().to(self.dtype)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool,
                layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Writes the batch's K/V into `pool` and returns float32 logits for `batch.logit_rows`.

        `layer_done(l)` runs once layer l's K/V of the whole batch sit in the pool, so a caller can
        ship that layer while the next one computes (layer-wise KV streaming).
        """
        cfg = self.cfg
        h = F.embedding(batch.tokens, self.w["embed"])
        cos = self.cos[batch.positions].unsqueeze(1)
        sin = self.sin[batch.positions].unsqueeze(1)
        n = h.shape[0]
        for li, layer in enumerate(self.layers):
            x = rms_norm(h, layer["attn_norm"], cfg.rms_eps)
            qkv = linear(x, layer["wqkv"])
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q = apply_rope(q.view(n, cfg.num_heads, cfg.head_dim), cos, sin)
            k = apply_rope(k.view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
            kc, vc = pool.keys(li), pool.values(li)
            kc[batch.slot_blocks, batch.slot_offsets] = k
            vc[batch.slot_blocks, batch.slot_offsets] = v
            attn = self._attention(q, k, v, kc, vc, batch)
            h = h + linear(attn.reshape(n, self.q_size), layer["wo"])
            x = rms_norm(h, layer["ffn_norm"], cfg.rms_eps)
            gate, up = linear(x, layer["w_gate_up"]).chunk(2, dim=-1)
            h = h + linear(F.silu(gate) * up, layer["w_down"])
            if layer_done is not None:
                layer_done(li)
        if batch.logit_rows.numel() == 0:
            return h.new_empty((0, self.lm_head.shape[0]), dtype=torch.float32)
        h = rms_norm(h[batch.logit_rows], self.w["norm"], cfg.rms_eps)
        return linear(h, self.lm_head).float()

    def _attention(self, q, k, v, kc, vc, batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        bs = kc.shape[1]
        for span in batch.prefills:
            sl = slice(span.start, span.start + span.length)
            qs = q[sl].transpose(0, 1).unsqueeze(0)
            if span.context == span.length:  # nothing cached: attend to the chunk itself
                ks, vs, mask, causal = k[sl], v[sl], None, True
            else:
                nblk = (span.context + bs - 1) // bs
                blk = span.blocks[:nblk]
                ks = kc[blk].flatten(0, 1)[: span.context]
                vs = vc[blk].flatten(0, 1)[: span.context]
                past = span.context - span.length
                qi = torch.arange(span.length, device=q.device).unsqueeze(1)
                kj = torch.arange(span.context, device=q.device).unsqueeze(0)
                mask, causal = kj <= qi + past, False
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=causal, enable_gqa=True,
            )
            out[sl] = o.squeeze(0).transpose(0, 1)
        if batch.decode_tables is not None:
            d0 = batch.decode_start
            qd = q[d0:].unsqueeze(2)  # [B, H, 1, D]
            tables = batch.decode_tables
            bsz, mb = tables.shape
            ks = kc[tables].view(bsz, mb * bs, *kc.shape[2:]).transpose(1, 2)
            vs = vc[tables].view(bsz, mb * bs, *vc.shape[2:]).transpose(1, 2)
            pos = torch.arange(mb * bs, device=q.device)
            mask = (pos.unsqueeze(0) < batch.decode_lens.unsqueeze(1)).view(bsz, 1, 1, mb * bs)
            o = F.scaled_dot_product_attention(qd, ks, vs, attn_mask=mask, enable_gqa=True)
            out[d0:] = o.squeeze(2)
        return out
