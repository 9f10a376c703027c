"""Weights of the linear layers as they sit in memory, and the kernel each uses per step shape.

Five kinds, all computing ``x @ w.T`` for activations ``x [M, K]``; the int4 and q8_0 kernels answer in
float32, int8 in bfloat16, the others in x's dtype:

- ``DenseWeight``: a float tensor, multiplied with MKL (shaped for it on the CPU, see ``dense_matmul``).
- ``Int4Weight``: GGUF's Q4_0/Q4_1 blocks exactly (codes 0..15, a float16 scale and offset per 32 weights).
- ``Int8Weight``: int8 per output channel with one scale per row (GGUF K-quants, or floats).
- ``Q8Weight``: a GGUF's Q8_0 blocks exactly (int8 with a float16 scale per 32).
- ``FP16Weight``: float16 in fbgemm's packed layout.

The int4 and Q8_0 kernels are `engine.native`'s. Below `native.panel_min_rows` rows the activations are
rounded to int16 per group of 32 (a relative error of ~1e-5: the first 16 greedy tokens of the quality prompts
equal float32's) and each group's dot product is integer; from there on the weights are dequantized into
float32 panels and multiplied with FMAs (compute-bound, where integer products are no faster on AVX2). On kernel
path ``avx512_vnni`` every row count instead takes int8 dot products of the weights packed at load
(`native.i8_matmul`), with the activations in two int8 digits (15 bits, ~5e-5): int8 activations alone (llama.cpp's
Q8_1) changed 12 of those 20 greedy outputs, bfloat16 (torch's int4 kernel, the fallback without a C compiler) 3 of
them. Which rows take the kernels and which the long-chunk matmul of the kernel path: `engine.linear_paths`.
"""

from __future__ import annotations

import torch

from engine import native
from engine.linear_paths import CodedWeight, dense_matmul, into, split_call
from engine.native import Workspace

GROUP = 32  # weights per int4 scale/offset group (GGUF's block size)
KERNEL_DTYPE = torch.bfloat16  # activation dtype of torch's int4/int8 CPU kernels (fp16/fp32 run unvectorized)


class DenseWeight:
    kind = "none"

    def __init__(self, w: torch.Tensor):
        self.w = w
        self.out_features, self.in_features = w.shape

    def __call__(self, x: torch.Tensor, dequant_rows: int = 0) -> torch.Tensor:
        return dense_matmul(x.to(self.w.dtype), self.w).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight as float32 (an embedding lookup)."""
        return self.w[ids].float()

    def dequantize(self) -> torch.Tensor:
        return self.w.float()

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix: self.w}


class Int4Weight(CodedWeight):
    """int4 codes (0..15) with a float16 scale d and offset m per group of 32 along a row, w = d q + m:
    GGUF's Q4_0/Q4_1 blocks exactly (Q4_0: m = -8 d).

    ``qs`` [n, k / 2] holds the codes in pairs of groups (byte i of pair p: element i of group 2p in the low
    nibble, of group 2p + 1 in the high one) and ``dm`` [n, 2, k / 32] the row's d's then its m's, as int16
    bits: `engine.native`'s kernel reads them as they are (kernel path avx512_vnni: a packed copy).
    Without that library, torch's int4 kernel on a copy in its own layout (bfloat16 activations).
    """

    kind = "int4"

    def __init__(self, qs: torch.Tensor, dm: torch.Tensor, workspace: Workspace | None = None):
        n, half = qs.shape
        if qs.dtype != torch.uint8 or half % GROUP or dm.shape != (n, 2, half * 2 // GROUP):
            raise ValueError(f"int4 weight: codes {qs.dtype} {tuple(qs.shape)} do not fit scales {tuple(dm.shape)}")
        self.qs = qs.contiguous()
        self.dm = dm.contiguous().view(torch.int16)  # float16 bits: safetensors and ctypes see plain integers
        self.out_features, self.in_features = n, half * 2
        self.workspace = workspace
        self._torch_layout: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_codes(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                   workspace: Workspace | None = None) -> Int4Weight:
        """From codes ``q`` [N, K] in 0..15 with ``w = d q + m``, d and m [N, K/32] (stored as float16)."""
        n, k = q.shape
        if n % 32 or k % (GROUP * 2):
            raise ValueError(f"int4 weight needs rows divisible by 32 and columns by 64, got {n}x{k}")
        pairs = q.to(torch.uint8).view(n, k // (2 * GROUP), 2, GROUP)
        qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, k // 2)
        return cls(qs, torch.stack([d, m], dim=1).to(torch.float16), workspace)

    @classmethod
    def quantize(cls, w: torch.Tensor, workspace: Workspace | None = None) -> Int4Weight:
        """Asymmetric min/max quantization of float weights, per group of 32 along each row."""
        n, k = w.shape
        g = w.float().reshape(n, k // GROUP, GROUP)
        lo = g.amin(-1).half().float()
        d = ((g.amax(-1) - lo) / 15).clamp_min(1e-7).half().float()
        q = ((g - lo.unsqueeze(-1)) / d.unsqueeze(-1)).round().clamp(0, 15).reshape(n, k)
        return cls.from_codes(q, d, lo, workspace)

    def codes(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """The codes [rows, K] (0..15) of some rows."""
        qs = self.qs[rows].view(-1, self.in_features // (2 * GROUP), GROUP)
        return torch.stack([qs & 15, qs >> 4], dim=2).view(qs.shape[0], self.in_features)

    def scales(self, rows: torch.Tensor | slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, m) [rows, K/32] as float32."""
        dm = self.dm[rows].view(torch.float16).float()
        return dm[:, 0], dm[:, 1]

    def panel_codes(self) -> tuple[str, torch.Tensor, torch.Tensor]:
        """What `engine.native`'s long-chunk matmuls take: (kind, codes, scales)."""
        return "int4", self.qs, self.dm

    def native_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return native.q4_matmul(x, self.qs, self.dm)

    def torch_kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self._torch_layout is None:
            d, m = self.scales()
            packed = torch._convert_weight_to_int4pack_for_cpu(self.codes().to(torch.int32), 2)
            self._torch_layout = packed, torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).to(KERNEL_DTYPE).contiguous()
        packed, scales_zeros = self._torch_layout
        return torch._weight_int4pack_mm_for_cpu(x.to(KERNEL_DTYPE), packed, GROUP, scales_zeros).float()

    def __call__(self, x: torch.Tensor, dequant_rows: int = 0) -> torch.Tensor:
        return split_call(self, x, dequant_rows)

    def dequantize_rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 weights of output rows [start, stop)."""
        out = torch.empty(stop - start, self.in_features, device=self.qs.device) if out is None else out
        if self.qs.device.type == "cpu" and native.available():
            return native.int4_dequantize(self.qs, self.dm, start, stop, out)
        return out.copy_(self.rows(torch.arange(start, stop)))

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_rows(0, self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        d, m = self.scales(ids)
        q = self.codes(ids).float().view(len(ids), -1, GROUP)
        return (q * d.unsqueeze(-1) + m.unsqueeze(-1)).view(len(ids), self.in_features)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + self.dm.numel() * self.dm.element_size()

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.q4": self.qs, f"{prefix}.q4_dm": self.dm}


class Int8Weight:
    """int8 weights with one bfloat16 scale per output row (``w = q * scale``)."""

    kind = "int8"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, workspace: Workspace | None = None):
        if q.dtype != torch.int8 or scales.shape != (q.shape[0],):
            raise ValueError(f"int8 weight: codes {q.dtype} {tuple(q.shape)}, scales {tuple(scales.shape)}")
        self.q = q
        self.scales = scales.to(KERNEL_DTYPE)
        self.out_features, self.in_features = q.shape
        self.workspace = workspace

    @classmethod
    def quantize(cls, w: torch.Tensor, workspace: Workspace | None = None) -> Int8Weight:
        """Symmetric per-row quantization; the scale is rounded to bfloat16 before the codes are chosen."""
        w = w.float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-10).to(KERNEL_DTYPE).float()
        q = (w / scale.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8)
        return cls(q, scale, workspace)

    def panel_codes(self) -> None:
        """None: a long chunk's rows dequantize (`engine.native` has no panels of per-row int8)."""
        return None

    def kernel(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return into(torch._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.q, self.scales), out)

    def __call__(self, x: torch.Tensor, dequant_rows: int = 0) -> torch.Tensor:
        return split_call(self, x, dequant_rows)

    def dequantize_rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 weights of output rows [start, stop)."""
        out = torch.empty(stop - start, self.in_features, device=self.q.device) if out is None else out
        return torch.mul(self.q[start:stop], self.scales[start:stop].float().unsqueeze(1), out=out)

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_rows(0, self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].float() * self.scales[ids].float().unsqueeze(1)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * self.scales.element_size()

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.int8": self.q, f"{prefix}.scales": self.scales}


class Q8Weight(CodedWeight):
    """A GGUF's Q8_0 blocks as they are: int8 codes with a float16 scale per 32 weights along a row
    (``w = scale * q``), so nothing is rounded again (a per-row int8 copy raised perplexity 0.5%).

    `engine.native`'s kernel answers in float32 (the LM head's logits keep their precision: bfloat16 logits
    tie at a step of 1/8); without that library, torch's per-row int8 kernel on a requantized copy.
    """

    kind = "q8_0"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, workspace: Workspace | None = None):
        if q.dtype != torch.int8 or q.shape[1] % GROUP or scales.shape != (q.shape[0], q.shape[1] // GROUP):
            raise ValueError(f"q8_0 weight: codes {q.dtype} {tuple(q.shape)}, scales {tuple(scales.shape)}")
        self.q = q
        self.scales = scales.view(torch.int16)  # float16 bits: safetensors and ctypes see plain integers
        self.out_features, self.in_features = q.shape
        self.workspace = workspace
        self._fallback: Int8Weight | None = None

    @classmethod
    def quantize(cls, w: torch.Tensor, workspace: Workspace | None = None) -> Q8Weight:
        """Float weights as Q8_0 blocks: per 32, a float16 scale amax / 127 and the codes nearest w / scale."""
        n, k = w.shape
        g = w.float().reshape(n, k // GROUP, GROUP)
        scale = (g.abs().amax(-1) / 127).half()
        inv = torch.where(scale == 0, 0.0, 1.0 / scale.float())
        q = (g * inv.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8).reshape(n, k)
        return cls(q, scale.view(torch.int16), workspace)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [n, k] int8, scales [n, k / 32] as int16 bits): what the constructor takes."""
        return self.q, self.scales

    def panel_codes(self) -> tuple[str, torch.Tensor, torch.Tensor]:
        """What `engine.native`'s long-chunk matmuls take: (kind, codes, scales)."""
        return "q8_0", self.q, self.scales

    def native_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return native.q8_matmul(x, self.q, self.scales)

    def torch_kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self._fallback is None:
            self._fallback = Int8Weight.quantize(self.dequantize())
        return self._fallback.kernel(x)

    def __call__(self, x: torch.Tensor, dequant_rows: int = 0) -> torch.Tensor:
        return split_call(self, x, dequant_rows)

    def dequantize_rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 weights of output rows [start, stop)."""
        n, groups = stop - start, self.in_features // GROUP
        out = torch.empty(n, self.in_features, device=self.q.device) if out is None else out
        scale = self.scales[start:stop].view(torch.float16).float().unsqueeze(-1)
        torch.mul(self.q[start:stop].view(n, groups, GROUP), scale, out=out.view(n, groups, GROUP))
        return out

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_rows(0, self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if native.available() and ids.device.type == "cpu" and self.q.device.type == "cpu":
            return native.q8_rows(self.q, self.scales, ids)  # one call, not eight torch operations
        scale = self.scales.index_select(0, ids).view(torch.float16).float().unsqueeze(-1)
        return (self.q.index_select(0, ids).view(len(ids), -1, GROUP) * scale).view(len(ids), self.in_features)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * self.scales.element_size()

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.q8": self.q, f"{prefix}.q8_scales": self.scales}


class FP16Weight:
    """float16 weights in fbgemm's packed layout, float32 activations and accumulation (x86 CPUs).

    Half the bytes of float32 with float32 arithmetic: no activation rounding, so a row's result
    depends on the other rows of its step only at float32 rounding, as with MKL.
    """

    kind = "fp16"

    def __init__(self, w16: torch.Tensor, workspace: Workspace | None = None):
        if w16.dtype != torch.float16:
            raise ValueError(f"fp16 weight: got {w16.dtype}")
        self.w16 = w16  # kept for embedding lookups and the weight cache; fbgemm holds its own packed copy
        self.packed = torch.ops.quantized.linear_prepack_fp16(w16.float(), None)
        self.out_features, self.in_features = w16.shape

    def __call__(self, x: torch.Tensor, dequant_rows: int = 0) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w16[ids].float()

    def dequantize(self) -> torch.Tensor:
        return self.w16.float()

    @property
    def nbytes(self) -> int:
        """fbgemm's packed copy plus the float16 tensor it came from (shared with the loaded model)."""
        return 2 * self.w16.numel() * 2

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.fp16": self.w16}


INTEGER_CODES = (".q4", ".q8", ".int8")  # the names under which `Weight.tensors` stores integer codes


def has_integer_weights(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether any weight among `tensors` (in `Weight.tensors`' naming) is stored as integer codes: int4, Q8_0
    or int8, not float16 or a float tensor."""
    return any(name.endswith(INTEGER_CODES) for name in tensors)


def fp16_supported() -> bool:
    """fbgemm (x86) has the packed float16 GEMM; elsewhere `fp16` weights stay dense."""
    return "fbgemm" in torch.backends.quantized.supported_engines


Weight = DenseWeight | Int4Weight | Int8Weight | Q8Weight | FP16Weight



def encode_weight(w: torch.Tensor, kind: str, prefix: str, dtype: torch.dtype = torch.float32
                  ) -> dict[str, torch.Tensor]:
    """Float weights stored as `kind` (none, fp16, int8, int4): the tensors `weight_from_tensors` reads."""
    if kind == "int4":
        return Int4Weight.quantize(w).tensors(prefix)
    if kind == "int8":
        return Int8Weight.quantize(w).tensors(prefix)
    if kind == "fp16":
        return {f"{prefix}.fp16": w.to(torch.float16).contiguous()}
    return {prefix: w.to(dtype)}


def weight_from_tensors(tensors: dict[str, torch.Tensor], prefix: str, workspace: Workspace | None = None) -> Weight:
    """Rebuild the weight stored under `prefix` by `Weight.tensors` (the weight cache, a loader)."""
    if f"{prefix}.q4" in tensors:
        return Int4Weight(tensors[f"{prefix}.q4"], tensors[f"{prefix}.q4_dm"], workspace)
    if f"{prefix}.q8" in tensors:
        return Q8Weight(tensors[f"{prefix}.q8"], tensors[f"{prefix}.q8_scales"], workspace)
    if f"{prefix}.int8" in tensors:
        return Int8Weight(tensors[f"{prefix}.int8"], tensors[f"{prefix}.scales"], workspace)
    if f"{prefix}.fp16" in tensors:
        w16 = tensors[f"{prefix}.fp16"]
        return FP16Weight(w16, workspace) if fp16_supported() else DenseWeight(w16.float())
    return DenseWeight(tensors[prefix])
