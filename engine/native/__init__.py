"""The forward pass in C (``csrc/``, a file per job; ``csrc/ops.h`` lists them): small operations, quantized
matmuls, whole layers; built when the package is installed and loaded with ctypes.

A decode step of the default model is ~30 layers of tiny tensors; in torch each RMSNorm, RoPE, KV write and
decode attention is several operations of 2-20 µs dispatch each, which added up to more than the matmuls.
Here each is one call, the int4/Q8_0 weights are multiplied as the GGUF stores them (`q4_matmul`,
`q8_matmul`), and a step's layers of such weights run as one call (`engine.native.layers`).

``setup.py`` compiles ``csrc/`` once per instruction-set variant (`engine.native.build`: ``avx512``,
``avx512_vnni``, ``avx2``, ``neon_dotprod``, ``portable``); `engine.native.dispatch` loads the best one the CPU runs and picks the kernel path.
Without one the engine runs torch's operations, which are not the same computation: int4 weights through
torch's bfloat16 kernel, Q8_0 re-quantized to int8 per channel (the start-up warning says so; `kernel_path` is
then ``torch``). Each call checks the tensors it hands over (`engine.native.tensors`: dtype, device, layout;
shapes here): ctypes passes bare addresses.
"""

from __future__ import annotations

import torch

from engine.native import huge_pages
from engine.native.dispatch import (
    BF16_MARGIN,
    DOTPROD,
    INVARIANT,
    KERNEL_PATHS,
    KINDS,
    PANEL_PRECISION,
    VNNI,
    available,
    bf16_attention_paths,
    kernel_path,
    kernel_paths,
    library,
    packs_i8,
    row_invariant,
    use_kernel_path,
    variant,
    variant_file,
)
from engine.native.layers import Layer, LayerStack, LayerStep, Linear, i8_linear, layer, linear
from engine.native.tensors import (
    POOL_DTYPES,
    I8Panels,
    Workspace,
    address,
    float_rows,
    pool_addresses,
    profiled,
    thread_count,
    weight_addresses,
)

__all__ = ["BF16_MARGIN", "DOTPROD", "INVARIANT", "KERNEL_PATHS", "KINDS", "PANEL_PRECISION", "POOL_DTYPES", "VNNI",
           "I8Panels", "Layer", "LayerStack", "LayerStep", "Linear", "Workspace", "argmax", "available", "bf16_attention_paths", "bf16_matmul",
           "chunk_attention", "float_rows", "has_chunk_attention", "i8_linear", "i8_matmul", "i8_pack", "q8_rows", "int4_dequantize",
           "kernel_path", "kernel_paths", "layer", "library", "linear", "packs_i8", "paged_attention",
           "panel_min_rows", "q4_matmul", "q8_matmul", "rms_norm", "rope_store", "row_invariant", "silu_mul",
           "use_kernel_path", "variant", "variant_file"]


@profiled("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of a contiguous float32 [m, n] tensor (into `out`, else a new tensor); with `residual`,
    x += residual first, in place."""
    m, n = x.shape
    res = None if residual is None else address(residual, torch.float32, "rms_norm's residual")
    if residual is not None and residual.shape != x.shape or weight.shape != (n,) \
            or out is not None and out.shape != x.shape:
        raise ValueError(f"rms_norm of {tuple(x.shape)} rows: residual {None if residual is None else tuple(residual.shape)}, "
                         f"weight {tuple(weight.shape)}, out {None if out is None else tuple(out.shape)}")
    if out is None:
        out = torch.empty_like(x)
    else:
        address(out, torch.float32, "rms_norm's out")
    library().tq_rms_norm(address(x, torch.float32, "rms_norm's rows"), res, address(weight, torch.float32, "rms_norm's weight"),
                          m, n, eps, out.data_ptr(), thread_count())
    return out


@profiled("silu_mul")
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the rows of a contiguous float32 [m, 2 f] tensor [gate | up]: [m, f]."""
    m, f2 = gate_up.shape
    out = torch.empty(m, f2 // 2, dtype=torch.float32)
    library().tq_silu_mul(address(gate_up, torch.float32, "silu_mul's rows"), m, f2 // 2, out.data_ptr(), thread_count())
    return out


@profiled("argmax")
def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, as torch.argmax(x, dim=-1) (first of equals, NaN first), for
    float32 [rows, n]; on the library's threads."""
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    library().tq_argmax(address(x, torch.float32, "argmax's rows"), x.shape[0], x.shape[1], out.data_ptr(), thread_count())
    return out


@profiled("q8_rows")
def q8_rows(q: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a Q8_0 weight (codes [n, k], float16 scales [n, k / 32]) as float32 [len(ids), k]: torch's
    q[ids] * scale, bit for bit, in one call (an embedding lookup)."""
    q_ptr, s_ptr, n, k = weight_addresses("q8_0", q, scales)
    out = torch.empty(ids.shape[0], k)
    if library().tq_q8_rows(q_ptr, s_ptr, n, k, address(ids, torch.long, "row ids"), ids.shape[0], out.data_ptr()):
        raise IndexError(f"row ids {ids.tolist()} of a weight of {n} rows")
    return out


@profiled("rope_store")
def rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
               kv_heads: int, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor,
               offsets: torch.Tensor) -> None:
    """RoPE on the q and k heads of `qkv` [m, (heads + 2 kv_heads) d] in place, then each row's k and v
    written to slot (blocks[i], offsets[i]) of the pool's `keys`/`values` [blocks, block_size, kv_heads, d]
    (float32, or float16 rounded to nearest even)."""
    m, width = qkv.shape
    d = cos.shape[-1]
    if positions.shape != (m,) or blocks.shape != (m,) or offsets.shape != (m,) or keys.shape[-1] != d:
        raise ValueError(f"rope_store of {m} rows: positions, blocks and offsets need one each, the pool head size {d}")
    k_ptr, v_ptr, half = pool_addresses(keys, values)
    library().tq_rope_store(address(qkv, torch.float32, "rope_store's qkv"), m, width,
                            address(positions, torch.long, "positions"), address(cos, torch.float32, "the cos table"),
                            address(sin, torch.float32, "the sin table"), heads, kv_heads, d, k_ptr, v_ptr,
                            keys.stride(0), address(blocks, torch.long, "slot blocks"),
                            address(offsets, torch.long, "slot offsets"), half, thread_count())


@profiled("paged_attention")
def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                    row_table: torch.Tensor, lens: torch.Tensor, heads: int, scale: float,
                    window: int = 0) -> torch.Tensor:
    """Causal attention of each query row (`q` [rows, heads * d], rows may be strided) over the first lens[r]
    tokens of the sequence with block table tables[row_table[r]] in the pool's `keys`/`values`
    [blocks, block_size, kv_heads, d] (only the last `window` of them when window > 0); returns
    [rows, heads * d]."""
    rows = q.shape[0]
    _, block_size, kv_heads, d = keys.shape
    if row_table.shape != (rows,) or lens.shape != (rows,):
        raise ValueError(f"paged_attention of {rows} rows: row_table {tuple(row_table.shape)}, lens {tuple(lens.shape)}")
    k_ptr, v_ptr, half = pool_addresses(keys, values)
    out = torch.empty(rows, heads * d, dtype=torch.float32)
    library().tq_paged_attention(address(q, torch.float32, "paged_attention's q", rows_apart=True), q.stride(0), k_ptr,
                                 v_ptr, keys.stride(0), address(tables, torch.long, "block tables", rows_apart=True),
                                 tables.stride(0), address(row_table, torch.long, "row_table"),
                                 address(lens, torch.long, "lens"), rows, heads, kv_heads, d, block_size, scale, window,
                                 out.data_ptr(), half, thread_count())
    return out


@profiled("q8_matmul")
def q8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ W.T as float32 [m, n] for GGUF Q8_0 weights (`engine.quant.Q8Weight`: int8 codes `q`
    [n, k], float16 scales, as int16 bits, [n, k / 32])."""
    return _quantized_matmul("tq_q8_matmul", "q8_0", x, q, scales)


@profiled("q4_matmul")
def q4_matmul(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ W.T as float32 [m, n] for int4 weights (`engine.quant.Int4Weight`: paired-group codes `qs`
    [n, k / 2], float16 (d, m), as int16 bits, [n, 2, k / 32]); below `panel_min_rows` rows x is quantized to
    int16 per group of 32, from there on the weights are dequantized to float32 panels."""
    return _quantized_matmul("tq_q4_matmul", "int4", x, qs, dm)


def panel_min_rows(kind: str) -> int:
    """The fewest rows a matmul of `kind` ("int4", "q8_0") computes with float32 panels instead of int16
    activations: a row's bits are the same in any batch on its side of this (csrc/panels.c says why it switches). Never
    on kernel paths invariant, avx512_vnni and neon_dotprod, whose kernel rows take one computation at any count."""
    if row_invariant() or packs_i8():
        return 2**63 - 1
    return int(library().tq_panel_min_rows(KINDS[kind]))


def _quantized_matmul(name: str, kind: str, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    x = float_rows(x)
    m, k = x.shape
    w_ptr, s_ptr, n, _ = weight_addresses(kind, w, scales, k)
    out = torch.empty(m, n, dtype=torch.float32)
    if getattr(library(), name)(w_ptr, s_ptr, n, k, address(x, torch.float32, "activations"), m, out.data_ptr(),
                                thread_count()):
        raise MemoryError(f"{kind} matmul of {m}x{k} by {n}x{k}: out of memory")
    return out


@profiled("bf16_matmul")
def bf16_matmul(kind: str, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ W.T as float32 [m, n] on bfloat16 panels, for the weights of `q4_matmul` / `q8_matmul`
    (`kind` "int4" or "q8_0"): operands rounded to bfloat16, sums in float32 (kernel path avx512_bf16)."""
    x = float_rows(x)
    m, k = x.shape
    w_ptr, s_ptr, n, _ = weight_addresses(kind, w, scales, k)
    out = torch.empty(m, n, dtype=torch.float32)
    rc = library().tq_bf16_matmul(KINDS[kind], w_ptr, s_ptr, n, k, address(x, torch.float32, "activations"), m,
                                  out.data_ptr(), thread_count())
    if rc:
        raise MemoryError(f"{kind} bfloat16 matmul of {m}x{k} by {n}x{k}: out of memory") if rc == -1 else \
            RuntimeError("this build has no AVX-512 BF16")
    return out




@profiled("i8_pack")
def i8_pack(kind: str, w: torch.Tensor, scales: torch.Tensor) -> I8Panels:
    """The weights of `q4_matmul` / `q8_matmul` (`kind` "int4" or "q8_0") packed for `i8_matmul`."""
    w_ptr, s_ptr, n, k = weight_addresses(kind, w, scales)
    lib = library()
    data = huge_pages.WEIGHTS.empty(lib.tq_i8_packed_bytes(KINDS[kind], n, k))
    lib.tq_i8_pack(KINDS[kind], w_ptr, s_ptr, n, k, data.data_ptr(), thread_count())
    return I8Panels(kind, n, k, data)


@profiled("i8_matmul")
def i8_matmul(x: torch.Tensor, w: I8Panels, digits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ W.T as float32 [m, n] on int8 dot products (kernel paths avx512_vnni and neon_dotprod, the same
    bits): x rounded per group of 32 to `digits` int8 digits (2: 15 bits, decode rows and short chunks; 1: 8 bits,
    long chunks), each group's dot product with the weights' codes exact in int32, then scaled and summed in
    float32. Into `out` where given (float32, contiguous [m, n]: a step's rows of two kinds share one output)."""
    x = float_rows(x)
    m, k = x.shape
    if k != w.k or digits not in (1, 2):
        raise ValueError(f"engine.native: i8_matmul of rows of {k} in {digits} digits by a {w.kind} weight of "
                         f"{w.n}x{w.k}")
    if out is None:
        out = torch.empty(m, w.n, dtype=torch.float32)
    elif out.shape != (m, w.n) or out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"engine.native: i8_matmul's out must be a contiguous float32 [{m}, {w.n}] CPU tensor, "
                         f"not {out.dtype} {list(out.shape)}")
    rc = library().tq_i8_matmul(KINDS[w.kind], address(w.data, torch.uint8, "i8 panels"), w.n, k,
                                address(x, torch.float32, "activations"), m, out.data_ptr(), digits, thread_count())
    if rc:
        raise MemoryError(f"{w.kind} int8 matmul of {m}x{k} by {w.n}x{k}: out of memory") if rc == -1 else \
            RuntimeError("this build has no int8 dot product (AVX-512 VNNI or ARMv8.2 dotprod)")
    return out


def has_chunk_attention() -> bool:
    """Whether this build has `chunk_attention` (AVX-512 F/BW)."""
    lib = library()
    return lib is not None and bool(lib.tq_has_chunk_attention())


@profiled("chunk_attention")
def chunk_attention(qkv: torch.Tensor, start: int, length: int, context: int, blocks: torch.Tensor,
                    keys: torch.Tensor, values: torch.Tensor, heads: int, scale: float, window: int,
                    out: torch.Tensor, bf16: bool) -> None:
    """Causal attention of the prompt chunk in rows [start, start + length) of `qkv` (float32, contiguous, query
    heads first) over the last `context` tokens' K/V in the pool (`keys`/`values` [blocks, block_size,
    kv_heads, d], through `blocks`), into the same rows of `out` [rows, heads * d], flash-attention style: in
    float32, or with `bf16` q, k, v and the softmax weights in bfloat16 with sums in float32 (kernel path
    avx512_bf16). Needs an AVX-512 build (`has_chunk_attention`; with `bf16`, AVX-512 BF16) and d a multiple of
    64 up to 256."""
    _, block_size, kv_heads, d = keys.shape
    if start + length > min(qkv.shape[0], out.shape[0]) or blocks.numel() * block_size < context:
        raise ValueError(f"chunk_attention of rows [{start}, {start + length}) over {context} tokens: qkv has "
                         f"{qkv.shape[0]} rows, out {out.shape[0]}, {blocks.numel()} blocks")
    k_ptr, v_ptr, half = pool_addresses(keys, values)
    rc = library().tq_chunk_attention(address(qkv[start:], torch.float32, "chunk_attention's qkv", rows_apart=True),
                                      qkv.stride(0), k_ptr, v_ptr, keys.stride(0),
                                      address(blocks.contiguous(), torch.long, "blocks"), length, context, heads,
                                      kv_heads, d, block_size, scale, window,
                                      address(out[start:], torch.float32, "chunk_attention's out", rows_apart=True),
                                      out.stride(0), half, int(bf16), thread_count())
    if rc:
        raise {-1: MemoryError(f"attention of {length} rows over {context} tokens: out of memory"),
               -2: RuntimeError(f"this build has no AVX-512{' BF16' if bf16 else ''}")}.get(
                   rc, ValueError(f"head size {d}: not a multiple of 64 up to 256"))


@profiled("int4_dequantize")
def int4_dequantize(qs: torch.Tensor, dm: torch.Tensor, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
    """Rows [start, stop) of an int4 weight (`engine.quant.Int4Weight`) as float32 into `out` [stop - start, k],
    in one pass."""
    w_ptr, s_ptr, n, k = weight_addresses("int4", qs, dm, out.shape[1])
    if not 0 <= start <= stop <= n or out.shape[0] < stop - start:
        raise ValueError(f"int4_dequantize of rows [{start}, {stop}) of {n} into {tuple(out.shape)}")
    library().tq_int4_dequant(w_ptr, s_ptr, k, start, stop, address(out, torch.float32, "int4_dequantize's out"),
                              thread_count())
    return out
