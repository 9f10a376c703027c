"""The decoder of every family in plain PyTorch, attending through a paged, block-major KV pool.

Llama's graph, plus what a family's config turns on (`engine.config.ModelConfig`, set by `engine.families`):
Q/K/V biases, per-head q/k RMSNorm, norms after attention and MLP, GELU(tanh), scaled embeddings, and
sliding-window layers with their own RoPE base.

One forward pass serves a mixed batch: any number of sequences each contributing a chunk of
new tokens. Linear layers run once over all tokens (their weights are dense or quantized, see
`engine.quant`); attention (`engine.attention`) runs per sequence for chunks longer than one token
(prefill) and batched for one-token chunks (decode). Everything that does not change between layers (RoPE
angles, the decode gather index and mask) is computed once per forward pass.

On a CPU with float32 activations the small per-layer operations (RMSNorm, RoPE with the K/V write,
attention through the pool) are `engine.native`'s C calls, one each instead of several torch operations;
the torch operations below are the same computation, for other devices and dtypes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import native
from engine.attention import DecodeAttention, PagedAttention, span_attention
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.linear_paths import KERNELS, CodedWeight
from engine.quant import DenseWeight, Int4Weight, Q8Weight, Weight, weight_from_tensors
from engine.rope import apply_rope, rope_frequencies
from kv.pool import KVPool


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wqkv: Weight
    wo: Weight
    ffn_norm: torch.Tensor
    w_gate_up: Weight
    w_down: Weight
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # of each query head, before RoPE
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # of the attention output, before it joins the residual
    post_ffn_norm: torch.Tensor | None = None
    window: int = 0  # tokens it attends to (0: all)
    rope: int = 0  # its RoPE table: 0 the model's, 1 the local layers'

    @property
    def linears(self) -> tuple[Weight, Weight, Weight, Weight]:
        """Its four linear weights in the order a forward pass multiplies them: qkv, o, gate-up, down."""
        return self.wqkv, self.wo, self.w_gate_up, self.w_down


class DecoderModel:
    """Weights: a flat dict of tensors in the loader's naming (fused QKV and gate/up; a quantized weight
    is several tensors under one prefix, see `engine.quant.Weight.tensors`)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.workspace = native.Workspace(self.device)

        def weight(name: str) -> Weight:
            w = weight_from_tensors(weights, name, self.workspace)
            if self.device.type != "cpu" and not isinstance(w, DenseWeight):
                w = DenseWeight(w.dequantize().to(dtype))  # the int4/int8 kernels here are CPU kernels
            if isinstance(w, DenseWeight):
                w = DenseWeight(w.w.to(self.device, dtype))
            return w

        def norm(name: str) -> torch.Tensor:
            return weights[name].to(self.device, dtype)

        def optional(name: str) -> torch.Tensor | None:
            return norm(name) if name in weights else None

        self.embed = weight("embed")
        self.lm_head = weight("lm_head") if _has(weights, "lm_head") else self.embed
        self.norm = norm("norm")
        self.ropes = [self._rope_table(cfg)]
        if cfg.local_layers and cfg.rope_local_theta and (cfg.rope_local_theta != cfg.rope_theta or cfg.rope_scaling):
            self.ropes.append(self._rope_table(dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta,
                                                                   rope_scaling=None)))
        self.cos, self.sin = self.ropes[0]
        self.layers = [
            Layer(norm(f"layers.{i}.attn_norm"), weight(f"layers.{i}.wqkv"), weight(f"layers.{i}.wo"),
                  norm(f"layers.{i}.ffn_norm"), weight(f"layers.{i}.w_gate_up"), weight(f"layers.{i}.w_down"),
                  optional(f"layers.{i}.wqkv_bias"), optional(f"layers.{i}.q_norm"), optional(f"layers.{i}.k_norm"),
                  optional(f"layers.{i}.post_attn_norm"), optional(f"layers.{i}.post_ffn_norm"), cfg.window(i),
                  int(i in cfg.local_layers and len(self.ropes) > 1))
            for i in range(cfg.num_layers)
        ]
        self.native = self.device.type == "cpu" and dtype == torch.float32 and native.available()
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self._fused: dict[str, native.LayerStack | None] = {}  # per kernel path: the int8 panels' are packed
        self.layer_scratch = native.Workspace()
        self._layer_step: native.LayerStep | None = None  # the last pass's, taken again for the same rows
        self.fused_layers()
        if isinstance(self.lm_head, CodedWeight):
            self.lm_head.pack()  # like the layers' panels
        # long prompt chunks may attend in bfloat16 (as their matmuls run on bfloat16 panels); float weights keep
        # float32 throughout, the reference the quality bench measures against
        self.quantized = any(isinstance(w, Int4Weight | Q8Weight) for w in self.linears)
        # called before each layer and after the last: a worker moving its threads on and off borrowed cores
        # (runtime/borrowing.py)
        self.before_layer: Callable[[], None] | None = None
        self.after_layers: Callable[[], None] | None = None

    @property
    def linears(self) -> list[Weight]:
        """Every layer's four linear weights, layer by layer (`Layer.linears`; the LM head not among them)."""
        return [w for layer in self.layers for w in layer.linears]

    def _rope_table(self, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (with rotate_half's sign folded in) of every position, [max_position, head_dim]."""
        inv = rope_frequencies(cfg).to(self.device)
        t = torch.arange(cfg.max_position, device=self.device, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        return torch.cat([freqs.cos(), freqs.cos()], dim=-1).to(self.dtype), \
            torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(self.dtype)

    def invariance_gaps(self) -> list[str]:
        """What would make a row's result depend on its step on the row-invariant kernel path (none: every row
        takes the int16 kernels and the C attention): torch's operations, or weights MKL or torch multiply."""
        gaps = [] if self.native else [f"{self.device.type} {self.dtype} runs torch's operations"]
        kinds = sorted({w.kind for w in [*self.linears, self.lm_head] if not isinstance(w, Int4Weight | Q8Weight)})
        return gaps + ([f"{', '.join(kinds)} weights"] if kinds else [])

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads (every linear layer, the LM head, the norms)."""
        norms = [t for layer in self.layers for t in (layer.attn_norm, layer.ffn_norm, layer.qkv_bias, layer.q_norm,
                                                       layer.k_norm, layer.post_attn_norm, layer.post_ffn_norm)
                 if t is not None] + [self.norm]
        return sum(w.nbytes for w in self.linears) + self.lm_head.nbytes + sum(t.numel() * t.element_size() for t in norms)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool,
                layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Writes the batch's K/V into `pool` and returns float32 logits for `batch.logit_rows`.

        `layer_done(l)` runs once layer l's K/V of the whole batch sit in the pool, so a caller can
        ship that layer while the next one computes (layer-wise KV streaming).
        """
        cfg = self.cfg
        h = self.embed.rows(batch.tokens)
        if h.dtype != self.dtype:  # a no-op `to` is still a torch call, each ~5-50 µs on a step's cold caches
            h = h.to(self.dtype)
        if cfg.embed_scale != 1.0:
            h.mul_(cfg.embed_scale)
        by_group = [batch.group(g) for g in range(pool.layout.num_groups)]
        pending = None  # the last layer's output, not yet added to h
        normed = None  # where the final norm may write its rows (the one-call layers' spare buffer)
        if self.native and pool.tensor.dtype in native.POOL_DTYPES:
            paged = [PagedAttention(b, cfg.num_heads, cfg.softmax_scale, self.quantized) for b in by_group]
            fused = self.fused_layers()
            if fused is not None and len(paged) == 1 and batch.dequant_rows == 0 and not paged[0].long_spans:
                pending = self._fused_forward(fused, h, batch, paged[0], pool, layer_done)
                normed = self._layer_step.normed
            else:
                self._layer_ops(h, batch, pool, layer_done, paged=paged)
        else:
            decode = [DecodeAttention(b, pool.layout.block_size, cfg.softmax_scale)
                      if b.decode_tables is not None else None for b in by_group]
            angles = [(cos.index_select(0, batch.positions).unsqueeze(1), sin.index_select(0, batch.positions).unsqueeze(1))
                      for cos, sin in self.ropes]
            self._layer_ops(h, batch, pool, layer_done, torch_attn=(decode, angles))
        if batch.logit_rows.numel() == 0:
            return h.new_empty((0, self.lm_head.out_features), dtype=torch.float32)
        if batch.logit_rows.numel() == h.shape[0]:  # every row, in order (a step of decode rows): the add in the norm
            h = self._norm(h, self.norm, pending, normed)
        else:
            if pending is not None:
                h.add_(pending)
            h = self._norm(h.index_select(0, batch.logit_rows), self.norm)
        rows = h.shape[0]  # one per sampled sequence: the kernel, always, so a token's logits never depend on its step
        logits = self.lm_head(h, rows if rows > KERNELS.lm_head_rows() else 0)
        return logits if logits.dtype == torch.float32 else logits.float()

    def _layer_ops(self, h: torch.Tensor, batch: ForwardBatch, pool: KVPool,
                   layer_done: Callable[[int], None] | None, paged: list[PagedAttention] | None = None,
                   torch_attn: tuple | None = None) -> None:
        """The layers one operation at a time (`paged`: engine.native's attention, per KV group; else torch's,
        with `torch_attn` = the decode attention per KV group and the RoPE angles of each table)."""
        cfg = self.cfg
        n, heads, kv_heads, hd = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk_size, dq = self.q_size + self.kv_size, batch.dequant_rows
        decodes, angles = torch_attn or (None, None)
        # int8 weights answer in bfloat16 (torch's kernel's dtype): the residual stream, RoPE and attention stay in
        # the model dtype (the adds promote). Each sublayer's output joins the residual stream in the next norm.
        out = None
        for li, layer in enumerate(self.layers):
            if self.before_layer is not None:
                self.before_layer()
            qkv = layer.wqkv(self._norm(h, layer.attn_norm, out), dq)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            if layer.q_norm is not None:
                qkv = self._qk_norm(qkv, layer)
            kc, vc = pool.keys(li), pool.values(li)
            group = pool.layout.group_of[li][0]
            gb = batch.group(group)
            slots = (gb.slot_blocks, batch.slot_offsets)
            if paged is not None:  # RoPE in place with the K/V write, then attention through the pool: two calls
                qkv = qkv.float().contiguous()
                cos, sin = self.ropes[layer.rope]
                native.rope_store(qkv, batch.positions, cos, sin, heads, kv_heads, kc, vc, *slots)
                attn = paged[group](qkv, self.q_size, kv_heads, kc, vc, layer.window)
            else:
                cos, sin = angles[layer.rope]
                qk = apply_rope(qkv[:, :qk_size].view(n, heads + kv_heads, hd), cos, sin)
                q, k = qk[:, :heads], qk[:, heads:]
                v = qkv[:, qk_size:].view(n, kv_heads, hd)
                kc.index_put_(slots, k.to(kc.dtype))
                vc.index_put_(slots, v.to(vc.dtype))
                attn = self._attention(q, k, v.to(q.dtype), kc, vc, gb, decodes[group], layer.window)
            out = layer.wo(attn.reshape(n, self.q_size), dq)
            if layer.post_attn_norm is not None:
                out = self._norm(out.to(h.dtype).contiguous(), layer.post_attn_norm)
            out = layer.w_down(self._gate(layer.w_gate_up(self._norm(h, layer.ffn_norm, out), dq)), dq)
            if layer.post_ffn_norm is not None:
                out = self._norm(out.to(h.dtype).contiguous(), layer.post_ffn_norm)
            if layer_done is not None:
                layer_done(li)
        if self.after_layers is not None:
            self.after_layers()
        if out is not None:
            h.add_(out)

    def _qk_norm(self, qkv: torch.Tensor, layer: Layer) -> torch.Tensor:
        """qkv with each query and key head RMS-normed (over head_dim, by q_norm / k_norm)."""
        n, hd, q_size = qkv.shape[0], self.cfg.head_dim, self.q_size
        qkv = qkv.to(self.dtype).contiguous()
        q = qkv[:, :q_size].reshape(-1, hd).contiguous()  # with one KV head, reshape is a strided view
        k = qkv[:, q_size:q_size + self.kv_size].reshape(-1, hd).contiguous()
        qkv[:, :q_size] = self._norm(q, layer.q_norm).view(n, q_size)
        qkv[:, q_size:q_size + self.kv_size] = self._norm(k, layer.k_norm).view(n, self.kv_size)
        return qkv

    def _fused_forward(self, fused: native.LayerStack, h: torch.Tensor, batch: ForwardBatch, paged: PagedAttention,
                       pool: KVPool, layer_done: Callable[[int], None] | None) -> torch.Tensor:
        """The layers in one `engine.native` call (all linear layers int4/Q8_0, every row on the kernels), or
        one call a layer where `layer_done` ships each layer's K/V as it lands or a worker borrowing cores decides
        layer by layer. Returns the last layer's output, which the caller adds to h."""
        cfg = self.cfg
        keys, values = pool.layer_views()
        rows = (batch.positions, batch.slot_blocks, batch.slot_offsets, paged.tables, paged.row_table, paged.lens,
                keys[0])
        step = self._layer_step
        if step is None or not step.again(h, rows, self.layer_scratch):
            step = self._layer_step = native.LayerStep(
                h, fused.layers[0], *rows[:3], self.cos, self.sin, cfg.num_heads, cfg.num_kv_heads, keys[0], *rows[3:6],
                cfg.rms_eps, cfg.softmax_scale, self.layer_scratch)
        if layer_done is None and self.before_layer is None:
            step.run(fused, keys, values)
            return step.pending
        for li in range(len(fused.layers)):
            if self.before_layer is not None:
                self.before_layer()
            step.run(fused, keys, values, li, li + 1)
            if layer_done is not None:
                layer_done(li)
        if self.after_layers is not None:
            self.after_layers()
        return step.pending

    def fused_layers(self) -> native.LayerStack | None:
        """The layers for `engine.native`'s one-call path on this process's kernel path, where every linear
        layer is a kind it multiplies; None elsewhere. Built once per path (the int8 panels' pack the weights)."""
        path = native.kernel_path()
        if path not in self._fused:
            self._fused[path] = self._fused_layers(native.packs_i8(path))
        return self._fused[path]

    def _fused_layers(self, packed: bool) -> native.LayerStack | None:
        if not self.native or not self.cfg.plain_llama:
            return None

        def linear(w: Weight) -> native.Linear | None:
            if not isinstance(w, Int4Weight | Q8Weight):
                return None
            return native.i8_linear(w.i8_panels()) if packed else native.linear(*w.panel_codes())

        layers = []
        for layer in self.layers:
            linears = [linear(w) for w in layer.linears]
            if any(lin is None for lin in linears):
                return None
            layers.append(native.layer(layer.attn_norm, layer.ffn_norm, *linears))
        return native.LayerStack(layers)

    def _norm(self, h: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of the rows of `h` (into `out`, where given, on the native path), after adding a sublayer's
        output `residual` to it (in place)."""
        if self.native and h.dtype == torch.float32:
            return native.rms_norm(h, weight, self.cfg.rms_eps, None if residual is None else native.float_rows(residual),
                                   out)
        if residual is not None:
            h.add_(residual)
        return F.rms_norm(h, (h.shape[-1],), weight, self.cfg.rms_eps)

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.cfg.activation == "gelu_tanh":
            gate, up = gate_up.chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh").mul_(up)
        if self.native and gate_up.dtype == torch.float32:
            return native.silu_mul(gate_up.contiguous())
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def _attention(self, q, k, v, kc, vc, batch: ForwardBatch, decode: DecodeAttention | None,
                   window: int) -> torch.Tensor:
        if not batch.prefills and decode is not None:
            return decode(q, kc, vc, window)
        out = torch.empty_like(q)
        for span in batch.prefills:
            span_attention(q, k, v, kc, vc, span, out, self.cfg.softmax_scale, window)
        if decode is not None:
            out[batch.decode_start:] = decode(q[batch.decode_start:], kc, vc, window)
        return out


def _has(weights: dict[str, torch.Tensor], prefix: str) -> bool:
    return prefix in weights or any(k.startswith(prefix + ".") for k in weights)
