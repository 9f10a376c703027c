"""What a call into the C hands over, checked: tensors as bare addresses once they are what the C reads there
(dtype, device, layout), quantized weights' codes and scales, views of the KV pool, the packed int8 panels, and
the profiler label and thread count every call carries. ctypes passes bare addresses: a mismatch is a ValueError
here, not a read of the wrong bytes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.autograd import profiler

F = TypeVar("F", bound=Callable)


class Workspace:
    """A grow-only float32 buffer a model keeps and reuses, one forward pass at a time (a LayerStep's buffers, a
    dequantized weight): fresh pages cost 20-40x a warm copy on first touch, and a slice or view per call is a
    torch call the hot path does without (`reserve`)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.buf = torch.empty(0, dtype=torch.float32, device=self.device)

    def reserve(self, n: int) -> torch.Tensor:
        """The whole buffer, of at least `n` floats."""
        if self.buf.numel() < n:
            self.buf = torch.empty(max(n, 2 * self.buf.numel()), dtype=torch.float32, device=self.device)
        return self.buf

    def take(self, rows: int, cols: int) -> torch.Tensor:
        """Its first ``rows * cols`` floats as a (rows, cols) matrix."""
        return self.reserve(rows * cols)[:rows * cols].view(rows, cols)


def profiled(name: str) -> Callable[[F], F]:
    """Show each call as ``tandem::<name>`` in torch's profiler while one records (a
    ``record_function`` range), and cost nothing more than a flag read otherwise. Not a
    ``torch.library`` custom op: that dispatch costs ~11 µs a call here (docs/architecture.md)."""

    def wrap(fn: F) -> F:
        label = f"tandem::{name}"

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if profiler._is_profiler_enabled:
                with torch.profiler.record_function(label):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


def float_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as contiguous float32, without a torch call where it is so already: a no-op conversion is still one,
    ~5-50 µs on the caches a decode step's weights leave."""
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def thread_count() -> int:
    """The threads a call runs on: torch's."""
    return torch.get_num_threads()


def address(t: torch.Tensor, dtypes: torch.dtype | tuple[torch.dtype, ...], what: str, rows_apart: bool = False) -> int:
    """`t`'s address for the C, once `t` is what the C reads there: CPU memory of one of `dtypes`, dense (with
    `rows_apart`: each row dense, the rows at t.stride(0), which the caller passes along). A mismatch is a
    ValueError here, not a read of the wrong bytes."""
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.device.type != "cpu" or t.dtype not in dtypes:
        names = " or ".join(str(dt).removeprefix("torch.") for dt in dtypes)
        raise ValueError(f"engine.native: {what} must be a CPU tensor of {names}, got {t.dtype} on {t.device}")
    dense = 1
    for size, stride in zip(reversed(t.shape[1:] if rows_apart else t.shape),
                            reversed(t.stride()[1:] if rows_apart else t.stride())):
        if size > 1 and stride != dense:
            raise ValueError(f"engine.native: {what} must be {'dense in each row' if rows_apart else 'contiguous'}, "
                             f"got shape {tuple(t.shape)} strides {t.stride()}")
        dense *= size
    return t.data_ptr()


POOL_DTYPES = (torch.float32, torch.float16)  # the KV pool dtypes the C attention reads


def pool_view(view: torch.Tensor, what: str) -> tuple[int, int]:
    """A view of the pool [blocks, block_size, kv_heads, d] (one block every view.stride(0)) for the C: its
    address, and 1 where it holds float16, 0 for float32 (what the C's K/V readers and writers take)."""
    return address(view, POOL_DTYPES, what, rows_apart=True), int(view.dtype == torch.float16)


def pool_addresses(keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int, int]:
    """The pool's key and value views for the C, laid out alike: their addresses and their float16 flag."""
    if values.shape != keys.shape or values.stride() != keys.stride() or values.dtype != keys.dtype:
        raise ValueError(f"engine.native: the pool's keys {tuple(keys.shape)} {keys.stride()} and values "
                         f"{tuple(values.shape)} {values.stride()} must be laid out alike")
    (k_ptr, half), (v_ptr, _) = pool_view(keys, "the pool's keys"), pool_view(values, "the pool's values")
    return k_ptr, v_ptr, half


CODE_DTYPES = {"int4": torch.uint8, "q8_0": torch.int8}  # each weight kind's code bytes


def weight_addresses(kind: str, w: torch.Tensor, scales: torch.Tensor, k: int | None = None) -> tuple[int, int, int, int]:
    """(codes, scales, n, k) of a `kind` weight for the C: int4 codes [n, k / 2] with float16 (d, m) [n, 2, k / 32],
    or Q8_0 codes [n, k] with float16 scales [n, k / 32] (scales as int16 bits); `k` the activations' width."""
    n, cols = w.shape
    width = cols * 2 if kind == "int4" else cols
    groups = scales.shape[0] == n and scales.numel() == n * width // 32 * (2 if kind == "int4" else 1)
    if (k is not None and width != k) or width % (64 if kind == "int4" else 32) or not groups:
        raise ValueError(f"engine.native: a {kind} weight of codes {tuple(w.shape)} and scales {tuple(scales.shape)} "
                         f"does not take rows of {k if k is not None else width}")
    return (address(w, CODE_DTYPES[kind], f"{kind} codes"), address(scales, (torch.int16, torch.float16), f"{kind} scales"), n,
            width)


@dataclass(frozen=True)
class I8Panels:
    """An int4 or Q8_0 weight [n, k] packed for `i8_matmul` (csrc/i8_pack.c `tq_i8_pack`: the same bytes, in panels of 32
    rows)."""

    kind: str
    n: int
    k: int
    data: torch.Tensor
