"""Which path a step's rows take through a quantized weight (`engine.quant`), and what the long-chunk paths need.

Two paths, chosen per chunk so that a token's result does not depend on what else is in its step beyond
its row count:

- the kernels read the compact weights directly; a row's result does not depend on the other rows
  (on either side of `panel_min_rows`; on kernel path ``avx512_vnni`` there is no such side: int8 dot products of
  the weights packed at load, `native.i8_matmul` with 15-bit activations, ~2x the int16 kernel at batch 1). Decode
  rows and short prefill chunks use them.
- for the rows of prefill chunks longer than ``KERNELS.kernel_max_chunk``: on kernel path ``avx512_vnni`` the same
  packed weights with 8-bit activations (`native.i8_matmul`, one digit: 1.3x the bfloat16 panels; perplexity
  x1.0017), on ``avx512_bf16`` bfloat16 panels of the compact weights (2-3x a float32 GEMM; perplexity x1.0000);
  elsewhere dequantize + MKL, where a float32 GEMM is faster than the kernel: the weights are expanded into a
  shared float32 workspace (in chunks of output rows) and multiplied in float32.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine import native
from engine.native import Workspace

_DEQUANT_ROWS = 4096  # output rows expanded at once on the dequantize path (bounds the workspace)


@dataclass
class KernelChoice:
    """Where the dequantize + MKL path takes over from the weight-only kernels (see bench/kernels.py: their
    float32 panels lead MKL up to ~256-512 rows; a chunk on them also takes the C attention, one query row
    at a time, which is what falls behind SDPA past ~128 tokens)."""

    kernel_max_chunk: int = 128  # prefill chunks up to this many tokens use the kernels, as decode rows do
    lm_head_kernel_max_rows: int = 256  # more logit rows than this (scoring a whole text) dequantize

    def long_chunk(self) -> int:
        """Prefill chunks longer than this leave the kernels (none on the row-invariant kernel path)."""
        return sys.maxsize if native.row_invariant() else self.kernel_max_chunk

    def lm_head_rows(self) -> int:
        """More logit rows than this dequantize the LM head (never on the row-invariant kernel path)."""
        return sys.maxsize if native.row_invariant() else self.lm_head_kernel_max_rows


KERNELS = KernelChoice()


def dense_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
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


KERNEL_DIGITS = 2  # kernel path avx512_vnni's kernel rows: two int8 digits (15 bits; one changed greedy outputs)


class CodedWeight:
    """A weight of int4/Q8_0 codes and its kernel rows on this process's path: int8 panels on avx512_vnni (packed
    on first use: a process on another path never packs, the model packs its layers when it loads on this one),
    the weight's own int16 kernel (`native_kernel`) on the other native paths, torch's (`torch_kernel`) without
    the native library."""

    _i8: native.I8Panels | None = None

    def i8_panels(self) -> native.I8Panels:
        if self._i8 is None:
            self._i8 = native.i8_pack(*self.panel_codes())
        return self._i8

    @staticmethod
    def on_panels() -> bool:
        """This process's kernel rows multiply on int8 panels."""
        return native.available() and native.packs_i8()

    def pack(self) -> None:
        """Pack the panels now where the kernel rows use them (at load, not in the first request's step)."""
        if self.on_panels():
            self.i8_panels()

    def kernel(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.on_panels():
            return native.i8_matmul(x, self.i8_panels(), KERNEL_DIGITS, out)
        return into(self.native_kernel(x) if native.available() else self.torch_kernel(x), out)


class QuantizedWeight(Protocol):
    """What `split_call` needs of a weight of integer codes (`engine.quant`'s Int4Weight, Q8Weight, Int8Weight)."""

    out_features: int
    in_features: int
    workspace: Workspace | None

    def kernel(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def panel_codes(self) -> tuple[str, torch.Tensor, torch.Tensor] | None: ...

    def i8_panels(self) -> native.I8Panels: ...

    def dequantize_rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor: ...


def split_call(weight: QuantizedWeight, x: torch.Tensor, dequant_rows: int) -> torch.Tensor:
    """Rows [0, dequant_rows) through the long-chunk path, the rest through the weight-only kernel, each into its
    rows of one output (a mixed step's prompt chunk and decode rows: no copy of either to join them)."""
    if dequant_rows <= 0:
        return weight.kernel(x)
    long_rows = _long_rows(weight)
    if dequant_rows >= x.shape[0]:
        return long_rows(x, None).to(x.dtype)
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32, device=x.device)
    long_rows(x[:dequant_rows], out[:dequant_rows])
    weight.kernel(x[dequant_rows:], out[dequant_rows:])
    return out.to(x.dtype)


def into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`result`, copied into `out` where one is given."""
    return result if out is None else out.copy_(result)


LongRows = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def _long_rows(weight: QuantizedWeight) -> LongRows:
    """A long chunk's matmul with `weight` on this process's kernel path, as float32 (into `out` where given):
    panels of its codes where the path has them and the weight gives them, else dequantize + MKL."""
    codes, precision = weight.panel_codes(), native.PANEL_PRECISION.get(native.kernel_path())
    if codes is None or precision is None:
        return lambda x, out: into(_dequant_matmul(weight, x), out)
    if precision == "int8":
        panels = weight.i8_panels()
        return lambda x, out: native.i8_matmul(x, panels, 1, out)
    kind, w, scales = codes
    return lambda x, out: into(native.bf16_matmul(kind, x, w, scales), out)


def _dequant_matmul(weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T in float32, the weights expanded into the workspace `_DEQUANT_ROWS` outputs at a time."""
    xf = x.float()
    n, k = weight.out_features, weight.in_features
    ws = weight.workspace or Workspace(x.device)
    if n <= _DEQUANT_ROWS:
        return dense_matmul(xf, weight.dequantize_rows(0, n, ws.take(n, k))).to(x.dtype)
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for start in range(0, n, _DEQUANT_ROWS):
        stop = min(n, start + _DEQUANT_ROWS)
        out[:, start:stop] = dense_matmul(xf, weight.dequantize_rows(start, stop, ws.take(stop - start, k)))
    return out.to(x.dtype)
