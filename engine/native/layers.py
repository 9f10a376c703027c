"""A decoder step's layers in one C call (``csrc/layer.c``): the weights of every layer as one array of
`Layer` structs (`LayerStack`), the step's rows, buffers and K/V layout as one struct (`LayerStep`). Used where
every linear layer is int4/Q8_0 and every row is on the kernels (`engine.model.DecoderModel.fused_layers`): the
same C functions as the per-operation path, in the same order, bit for bit, without Python between them."""

from __future__ import annotations

import ctypes

import torch

from engine.native.dispatch import KINDS, library
from engine.native.tensors import (
    I8Panels,
    Workspace,
    address,
    pool_view,
    profiled,
    thread_count,
    weight_addresses,
)

I8_PANELS = 16  # csrc/layer.c's KIND_I8: a `Linear` of packed panels
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class Linear(ctypes.Structure):
    _fields_ = [("kind", _I64), ("w", _PTR), ("scales", _PTR), ("n", _I64), ("k", _I64)]


class Layer(ctypes.Structure):
    """One decoder layer's weights for tq_decoder_layer (pointers: the tensors must outlive it)."""

    _fields_ = [("attn_norm", _PTR), ("ffn_norm", _PTR), ("wqkv", Linear), ("wo", Linear), ("gate_up", Linear),
                ("down", Linear)]


class _LayerStep(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("m", "hidden", "q_size", "width", "ffn")] \
        + [(name, _PTR) for name in ("h", "res", "x", "qkv", "attn", "gu", "act", "positions", "blocks", "offsets",
                                     "cos_t", "sin_t")] \
        + [(name, _I64) for name in ("heads", "kv_heads", "d", "block_size", "block_stride")] \
        + [("tables", _PTR), ("row_table", _PTR), ("lens", _PTR), ("table_stride", _I64), ("eps", _F32),
           ("scale", _F32), ("has_res", _I64), ("threads", _I64), ("kv_half", _I64)]


def linear(kind: str, w: torch.Tensor, scales: torch.Tensor) -> Linear:
    w_ptr, s_ptr, n, k = weight_addresses(kind, w, scales)
    return Linear(KINDS[kind], w_ptr, s_ptr, n, k)


def i8_linear(w: I8Panels) -> Linear:
    """A layer's weight as `tq_decoder_layer` multiplies it on the int8 panels' paths (`i8_matmul`, two digits)."""
    return Linear(KINDS[w.kind] | I8_PANELS, address(w.data, torch.uint8, "i8 panels"), None, w.n, w.k)


def layer(attn_norm: torch.Tensor, ffn_norm: torch.Tensor, wqkv: Linear, wo: Linear, gate_up: Linear,
          down: Linear) -> Layer:
    hidden = attn_norm.shape[0]
    if ffn_norm.shape != (hidden,) or wqkv.k != hidden or wo.n != hidden or gate_up.k != hidden or down.n != hidden \
            or down.k * 2 != gate_up.n:
        raise ValueError(f"engine.native: a decoder layer of hidden size {hidden} with linear layers (n, k) "
                         f"{[(li.n, li.k) for li in (wqkv, wo, gate_up, down)]}")
    return Layer(address(attn_norm, torch.float32, "attn_norm"), address(ffn_norm, torch.float32, "ffn_norm"), wqkv, wo,
                 gate_up, down)


class LayerStep:
    """The buffers and row metadata of one forward pass that runs its layers in `tq_decoder_layers` calls:
    `h` [m, hidden] (the residual stream, updated in place), `pending` (the last layer's MLP output, which
    the caller adds to h) and `normed` (rows the caller may write once the layers ran: the final norm's). The
    buffers are carved from `scratch`, a grow-only float32 buffer the caller keeps between steps: a decode step's
    Python runs on caches the weights have just streamed through, where each torch allocation costs ~50 µs."""

    def __init__(self, h: torch.Tensor, first: Layer, positions: torch.Tensor, blocks: torch.Tensor,
                 offsets: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                 keys: torch.Tensor, tables: torch.Tensor, row_table: torch.Tensor, lens: torch.Tensor, eps: float,
                 scale: float, scratch: Workspace):
        m, hidden = h.shape
        _, block_size, _, d = keys.shape
        width, ffn = first.wqkv.n, first.gate_up.n // 2
        columns = (hidden, hidden, width, heads * d, 2 * ffn, ffn)  # res, x, qkv, attn, gu, act: each [m, cols]
        flat = scratch.reserve(m * sum(columns))
        starts = [flat.data_ptr() + 4 * m * sum(columns[:i]) for i in range(len(columns))]
        self.pending = flat[: m * hidden].view(m, hidden)  # the last layer's MLP output, which the caller adds to h
        self.normed = flat[m * hidden: 2 * m * hidden].view(m, hidden)  # x's buffer: free once the layers ran
        self.h = h
        self.rows = (positions, blocks, offsets, tables, row_table, lens, keys)  # what `again` compares
        self._flat = flat  # scratch's buffer when this step was made
        self._keep = (cos, sin)
        if first.wqkv.k != hidden or any(t.shape != (m,) for t in (positions, blocks, offsets, row_table, lens)):
            raise ValueError(f"a decoder layer step of {m} rows of {hidden}: one position, slot, table row and length "
                             f"each, and layers of that hidden size")
        _, half = pool_view(keys, "the pool's keys")
        self.s = _LayerStep(m, hidden, heads * d, width, ffn, address(h, torch.float32, "the residual stream"),
                            *starts, address(positions, torch.long, "positions"),
                            address(blocks, torch.long, "slot blocks"), address(offsets, torch.long, "slot offsets"),
                            address(cos, torch.float32, "the cos table"), address(sin, torch.float32, "the sin table"),
                            heads, kv_heads, d, block_size, keys.stride(0),
                            address(tables, torch.long, "block tables", rows_apart=True),
                            address(row_table, torch.long, "row_table"), address(lens, torch.long, "lens"), tables.stride(0),
                            eps, scale, 0, thread_count(), half)
        self.pool = (keys.stride(), keys.dtype)

    def again(self, h: torch.Tensor, rows: tuple[torch.Tensor, ...], scratch: Workspace) -> bool:
        """Take `h` as the residual stream of another pass over the same rows: True where `rows` are the very
        tensors this step was made with (positions, slot blocks and offsets, block tables, row table, lengths, the
        pool's keys: `engine.model_runner` hands a run of decode steps of one batch size the same views, rewritten)
        and its buffers are still `scratch`'s, so none of their addresses needs taking and checking again."""
        if h.shape != self.pending.shape or scratch.buf is not self._flat or len(rows) != len(self.rows) \
                or any(a is not b for a, b in zip(rows, self.rows)):
            return False
        self.s.h = address(h, torch.float32, "the residual stream")
        self.s.has_res = 0
        self.h = h
        return True

    @profiled("decoder_layers")
    def run(self, stack: LayerStack, keys: list[torch.Tensor], values: list[torch.Tensor], first: int = 0,
            last: int | None = None) -> None:
        """Layers [first, last) of `stack` in one call (default: all), layer l on `keys[l]`/`values[l]`, the
        views of one pool (laid out as the first layer's were)."""
        keys_at, values_at = stack.pool_addresses(keys, values, self.pool)
        self.s.threads = thread_count()  # a worker borrowing cores moves its thread count between layers
        last = len(stack.layers) if last is None else last
        if not 0 <= first < last <= len(stack.layers):
            raise ValueError(f"layers {first}-{last - 1} of a stack of {len(stack.layers)}")
        if library().tq_decoder_layers(stack.array, first, last, ctypes.byref(self.s), keys_at, values_at):
            raise MemoryError(f"decoder layers {first}-{last - 1} of {self.s.m} rows: out of memory")


class LayerStack:
    """A model's layers as one array for `tq_decoder_layers`, with the addresses of the K/V views of the pool
    they last ran on (checked once per pool, not once per layer and step)."""

    def __init__(self, layers: list[Layer]):
        self.layers = layers
        self.array = (Layer * len(layers))(*layers)
        self._views: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._addresses: tuple[ctypes.Array, ctypes.Array] | None = None

    def pool_addresses(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                       layout: tuple[tuple[int, ...], torch.dtype]) -> tuple[ctypes.Array, ctypes.Array]:
        """Arrays of each layer's key and value view addresses; every view laid out as `layout` (strides, dtype)."""
        if self._views is None or self._views[0] is not keys or self._views[1] is not values:
            if len(keys) != len(self.layers) or len(values) != len(self.layers):
                raise ValueError(f"{len(keys)} key and {len(values)} value views for {len(self.layers)} layers")
            for view in (*keys, *values):
                if (view.stride(), view.dtype) != layout:
                    raise ValueError(f"layer K/V views {view.stride()} {view.dtype} unlike the step's {layout}")
            self._addresses = ((_PTR * len(keys))(*(k.data_ptr() for k in keys)),
                               (_PTR * len(values))(*(v.data_ptr() for v in values)))
            self._views = (keys, values)
        assert self._addresses is not None
        return self._addresses


