"""The forward pass in C (``ops.c``): small operations, quantized matmuls, whole layers; built when the
package is installed and loaded with ctypes.

A decode step of the default model is ~30 layers of tiny tensors; in torch each RMSNorm, RoPE, KV write and
decode attention is several operations of 2-20 µs dispatch each, which added up to more than the matmuls.
Here each is one call, the int4/Q8_0 weights are multiplied as the GGUF stores them (`q4_matmul`,
`q8_matmul`), and a layer of such weights can run as one call (`LayerStep`).

``setup.py`` compiles ``ops.c`` once per instruction-set variant (`engine.native.build`: ``avx512``,
``avx2``, ``portable``); a process loads the best one its CPU runs, or the one ``TANDEM_NATIVE`` names
(``off``/``0``: none). A library built from another ``ops.c`` is refused (rebuild: ``pip install -e .``, or
``python setup.py build_ext --inplace``). Without one the engine runs torch's operations, which are not the
same computation: int4 weights through torch's bfloat16 kernel, Q8_0 re-quantized to int8 per channel (the
start-up warning says so; `kernel_path` is then ``torch``).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from engine.native.build import VARIANTS, Variant, cpu_flags, source_hash

log = logging.getLogger("tandem.native")

_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "tq_source_hash": [],
    "tq_rms_norm": [_P, _P, _P, _I, _I, _F, _P, _C],
    "tq_silu_mul": [_P, _I, _I, _P, _C],
    "tq_argmax": [_P, _I, _I, _P, _C],
    "tq_rope_store": [_P, _I, _I, _P, _P, _P, _C, _C, _C, _P, _P, _I, _P, _P, _C, _C],
    "tq_paged_attention": [_P, _I, _P, _P, _I, _P, _I, _P, _P, _I, _C, _C, _C, _C, _F, _I, _P, _C, _C],
    "tq_q8_matmul": [_P, _P, _I, _I, _P, _I, _P, _C],
    "tq_q4_matmul": [_P, _P, _I, _I, _P, _I, _P, _C],
    "tq_int4_dequant": [_P, _P, _I, _I, _I, _P, _C],
    "tq_decoder_layer": [_P, _P, _P, _P],
    "tq_panel_min_rows": [_C],
    "tq_set_row_invariant": [_C],
    "tq_has_bf16": [],
    "tq_bf16_matmul": [_C, _P, _P, _I, _I, _P, _I, _P, _C],
    "tq_bf16_attention": [_P, _I, _P, _P, _I, _P, _I, _I, _C, _C, _C, _C, _F, _I, _P, _I, _C, _C],
    "tq_probe_fma": [_I, _C],
    "tq_probe_bf16": [_I, _C],
    "tq_probe_vnni": [_I, _C],
    "tq_probe_read": [_P, _I, _C],
}
RETURNS = {"tq_source_hash": ctypes.c_char_p, "tq_q8_matmul": ctypes.c_int, "tq_q4_matmul": ctypes.c_int,
           "tq_decoder_layer": ctypes.c_int, "tq_panel_min_rows": ctypes.c_int64,
           "tq_has_bf16": ctypes.c_int, "tq_bf16_matmul": ctypes.c_int, "tq_bf16_attention": ctypes.c_int,
           "tq_probe_fma": ctypes.c_double, "tq_probe_bf16": ctypes.c_double, "tq_probe_vnni": ctypes.c_double,
           "tq_probe_read": ctypes.c_float}
_OFF = ("0", "off", "false", "no")
_FALLBACK = ("using torch's operations (slower decode; int4 in bfloat16 and Q8_0 re-quantized per channel: "
             "not the native path's numbers)")


def variant_file(variant: Variant) -> Path | None:
    """Where ``setup.py`` put this variant's library, or None where it was not built."""
    here = Path(__file__).parent
    return next((f for suffix in importlib.machinery.EXTENSION_SUFFIXES
                 if (f := here / f"{variant.module}{suffix}").exists()), None)


def _pick_variant() -> tuple[Variant, Path]:
    """The variant ``TANDEM_NATIVE`` names, else the best built one this CPU runs, and its library file
    (OSError says why none)."""
    wanted = os.environ.get("TANDEM_NATIVE", "auto").lower()
    flags = cpu_flags()
    if wanted not in ("auto", "1", "on", "true", "yes"):
        variant = next((v for v in VARIANTS if v.name == wanted), None)
        if variant is None:
            raise ValueError(f"TANDEM_NATIVE={wanted!r}: expected auto, off or one of "
                             f"{', '.join(v.name for v in VARIANTS)}")
        if not variant.runs_on(flags):
            missing = sorted(set(variant.cpu_flags) - flags)
            raise ValueError(f"TANDEM_NATIVE={wanted}: this CPU cannot run it (it lacks {', '.join(missing)})")
        path = variant_file(variant)
        if path is None:
            raise OSError(f"the {wanted} build of engine/native/ops.c is not installed")
        return variant, path
    runnable = [v for v in VARIANTS if v.runs_on(flags)]
    built = [(v, path) for v in runnable if (path := variant_file(v)) is not None]
    if not built:
        raise OSError("no build of engine/native/ops.c is installed for this CPU (a compiler was missing at "
                      "install time?)")
    if built[0][0] is not runnable[0]:
        log.warning("engine.native: the %s build is not installed; using the %s build", runnable[0].name,
                    built[0][0].name)
    return built[0]


@cache
def library() -> ctypes.CDLL | None:
    """The compiled ops, or None (and one warning saying why) where none is installed for this CPU."""
    if os.environ.get("TANDEM_NATIVE", "auto").lower() in _OFF:
        log.info("engine.native: off (TANDEM_NATIVE); %s", _FALLBACK)
        return None
    try:
        variant, path = _pick_variant()
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("engine.native: %s; %s", e, _FALLBACK)
        return None
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, RETURNS.get(name)
    built_from = lib.tq_source_hash().decode()
    if built_from != source_hash():
        log.warning("engine.native: %s was built from another ops.c (rebuild it: pip install -e . or python "
                    "setup.py build_ext --inplace); %s", path.name, _FALLBACK)
        return None
    _variant[0] = variant.name
    paths = _paths(lib)
    wanted = os.environ.get("TANDEM_KERNELS", "auto")
    if wanted not in ("auto", *paths):
        raise ValueError(f"TANDEM_KERNELS={wanted!r}: this CPU and build have {', '.join(paths)} (or auto; "
                         f"TANDEM_NATIVE=0 for torch's operations)")
    _choose(lib, paths[0] if wanted == "auto" else wanted)
    log.info("engine.native: the %s build, kernel path %s", variant.name, _chosen[0])
    return lib


def variant() -> str:
    """Which build of ops.c this process runs (`engine.native.build.VARIANTS`), or ``none``."""
    return _variant[0] if library() is not None else "none"


def available() -> bool:
    return library() is not None


INVARIANT = "invariant"
KERNEL_PATHS = ("avx512_bf16", "avx2", "portable", INVARIANT)  # every path a build can have; see kernel_path
_chosen = ["torch"]
_variant = ["none"]


def _paths(lib: ctypes.CDLL) -> list[str]:
    simd = ["avx2"] if lib.tq_panel_min_rows(KINDS["int4"]) < 2**62 else ["portable"]
    if lib.tq_has_bf16():
        simd = ["avx512_bf16", *simd] if _bf16_pays(lib) else [*simd, "avx512_bf16"]
    return [*simd, INVARIANT]


BF16_MARGIN = 1.2  # the probe is short: a near tie keeps float32 (0.5x and 2x were seen, nothing between)


@cache
def _bf16_pays(lib: ctypes.CDLL) -> bool:
    """Whether this CPU's bfloat16 dot products outrun its float32 FMAs, measured once (~3 ms, one thread).
    Having the instruction is not enough: AMD Zen 4 runs it at twice the float32 rate, where its bfloat16
    panels prefill 1.5-1.8x faster; some Xeons at half, where dequantize + float32 GEMM prefills 1.5x faster."""
    def rate(probe: Callable[[int, int], float]) -> float:
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            done = probe(100_000, 1)
            best = max(best, done / (time.perf_counter() - t))
        return best
    return rate(lib.tq_probe_bf16) > BF16_MARGIN * rate(lib.tq_probe_fma)


def _choose(lib: ctypes.CDLL, path: str) -> None:
    _chosen[0] = path
    lib.tq_set_row_invariant(int(path == INVARIANT))


def kernel_paths() -> list[str]:
    """The kernel paths this CPU and build have, fastest first (``auto`` takes the first); [] without the
    library."""
    lib = library()
    return _paths(lib) if lib is not None else []


def kernel_path() -> str:
    """How this process multiplies int4/Q8_0 weights: ``avx512_bf16`` (long prompt chunks on bfloat16 panels,
    everything else as ``avx2``), ``avx2`` (int16 activations and float32 panels; long chunks dequantized
    for a float32 GEMM), ``portable`` (the C without SIMD), ``invariant`` (every row on the int16 kernels and
    the C attention, whatever its step holds: a row's bits never depend on its batch; chosen only when asked
    for) or ``torch`` (no native library). The fastest the CPU has (`kernel_paths`) is chosen at start-up, or the one
    ``TANDEM_KERNELS`` (``--kernels``) names."""
    return _chosen[0] if library() is not None else "torch"


def row_invariant() -> bool:
    """Whether every row takes the same path in any step (kernel path ``invariant``)."""
    return kernel_path() == INVARIANT


def use_kernel_path(path: str) -> None:
    """Switch this process's path (a worker's ``--kernels``, where ``auto`` is the fastest; tests and benchmarks
    compare them side by side)."""
    lib = library()
    if path == "auto":
        if lib is None:
            return
        path = _paths(lib)[0]
    if lib is None or path not in _paths(lib):
        have = ", ".join(_paths(lib)) if lib is not None else "none: the native library is not built here"
        raise ValueError(f"kernel path {path!r} is not available here (this CPU and build have {have})")
    _choose(lib, path)


def _threads() -> int:
    return torch.get_num_threads()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of a contiguous float32 [m, n] tensor (a new tensor); with `residual`, x += residual
    first, in place."""
    m, n = x.shape
    if not x.is_contiguous() or x.dtype != torch.float32 or (residual is not None and not residual.is_contiguous()):
        raise ValueError(f"rms_norm takes contiguous float32 rows, got {x.dtype} strides {x.stride()}")
    out = torch.empty_like(x)
    library().tq_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), m, n,
                          eps, out.data_ptr(), _threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the rows of a contiguous float32 [m, 2 f] tensor [gate | up]: [m, f]."""
    m, f2 = gate_up.shape
    out = torch.empty(m, f2 // 2, dtype=torch.float32)
    library().tq_silu_mul(gate_up.data_ptr(), m, f2 // 2, out.data_ptr(), _threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, as torch.argmax(x, dim=-1) (first of equals, NaN first), for
    float32 [rows, n]; on the library's threads."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    library().tq_argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), _threads())
    return out


POOL_DTYPES = (torch.float32, torch.float16)  # the KV pool dtypes the C attention reads


def kv_half(keys: torch.Tensor) -> int:
    """1 for a float16 pool, 0 for float32 (what ops.c's K/V readers and writers take)."""
    if keys.dtype not in POOL_DTYPES:
        raise ValueError(f"engine.native's attention reads a float32 or float16 KV pool, not {keys.dtype}")
    return int(keys.dtype == torch.float16)


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
               kv_heads: int, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor,
               offsets: torch.Tensor) -> None:
    """RoPE on the q and k heads of `qkv` [m, (heads + 2 kv_heads) d] in place, then each row's k and v
    written to slot (blocks[i], offsets[i]) of the pool's `keys`/`values` [blocks, block_size, kv_heads, d]
    (float32, or float16 rounded to nearest even)."""
    m, width = qkv.shape
    d = cos.shape[-1]
    library().tq_rope_store(qkv.data_ptr(), m, width, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), heads,
                            kv_heads, d, keys.data_ptr(), values.data_ptr(), keys.stride(0), blocks.data_ptr(),
                            offsets.data_ptr(), kv_half(keys), _threads())


def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                    row_table: torch.Tensor, lens: torch.Tensor, heads: int, scale: float,
                    window: int = 0) -> torch.Tensor:
    """Causal attention of each query row (`q` [rows, heads * d], rows may be strided) over the first lens[r]
    tokens of the sequence with block table tables[row_table[r]] in the pool's `keys`/`values`
    [blocks, block_size, kv_heads, d] (only the last `window` of them when window > 0); returns
    [rows, heads * d]."""
    rows = q.shape[0]
    _, block_size, kv_heads, d = keys.shape
    out = torch.empty(rows, heads * d, dtype=torch.float32)
    library().tq_paged_attention(q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), keys.stride(0),
                                 tables.data_ptr(), tables.stride(0), row_table.data_ptr(), lens.data_ptr(), rows,
                                 heads, kv_heads, d, block_size, scale, window, out.data_ptr(), kv_half(keys), _threads())
    return out


def q8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ W.T as float32 [m, n] for GGUF Q8_0 weights (`engine.quant.Q8Weight`: int8 codes `q`
    [n, k], float16 scales, as int16 bits, [n, k / 32])."""
    return _quantized_matmul("tq_q8_matmul", "q8_0", x, q, scales)


def q4_matmul(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ W.T as float32 [m, n] for int4 weights (`engine.quant.Int4Weight`: paired-group codes `qs`
    [n, k / 2], float16 (d, m), as int16 bits, [n, 2, k / 32]); below `panel_min_rows` rows x is quantized to
    int16 per group of 32, from there on the weights are dequantized to float32 panels."""
    return _quantized_matmul("tq_q4_matmul", "int4", x, qs, dm)


def panel_min_rows(kind: str) -> int:
    """The fewest rows a matmul of `kind` ("int4", "q8_0") computes with float32 panels instead of int16
    activations: a row's bits are the same in any batch on its side of this (ops.c says why it switches)."""
    return 2**63 - 1 if row_invariant() else int(library().tq_panel_min_rows(KINDS[kind]))


def _quantized_matmul(name: str, kind: str, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    x = x.float().contiguous()
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if getattr(library(), name)(w.data_ptr(), scales.data_ptr(), n, k, x.data_ptr(), m, out.data_ptr(), _threads()):
        raise MemoryError(f"{kind} matmul of {m}x{k} by {n}x{k}: out of memory")
    return out


def bf16_matmul(kind: str, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ W.T as float32 [m, n] on bfloat16 panels, for the weights of `q4_matmul` / `q8_matmul`
    (`kind` "int4" or "q8_0"): operands rounded to bfloat16, sums in float32 (kernel path avx512_bf16)."""
    x = x.float().contiguous()
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    rc = library().tq_bf16_matmul(KINDS[kind], w.data_ptr(), scales.data_ptr(), n, k, x.data_ptr(), m,
                                  out.data_ptr(), _threads())
    if rc:
        raise MemoryError(f"{kind} bfloat16 matmul of {m}x{k} by {n}x{k}: out of memory") if rc == -1 else \
            RuntimeError("this build has no AVX-512 BF16")
    return out


def bf16_attention(qkv: torch.Tensor, start: int, length: int, context: int, blocks: torch.Tensor,
                   keys: torch.Tensor, values: torch.Tensor, heads: int, scale: float, window: int,
                   out: torch.Tensor) -> None:
    """Causal attention of the prompt chunk in rows [start, start + length) of `qkv` (float32, contiguous, query
    heads first) over the last `context` tokens' K/V in the pool (`keys`/`values` [blocks, block_size,
    kv_heads, d], through `blocks`), into the same rows of `out` [rows, heads * d]: q, k, v and the softmax
    weights in bfloat16, sums in float32 (kernel path avx512_bf16; d a multiple of 64)."""
    if qkv.dtype != torch.float32 or not qkv.is_contiguous() or not out.is_contiguous() or blocks.dtype != torch.long:
        raise ValueError("bf16_attention takes contiguous float32 qkv and out, int64 blocks")
    _, block_size, kv_heads, d = keys.shape
    rc = library().tq_bf16_attention(qkv[start:].data_ptr(), qkv.stride(0), keys.data_ptr(), values.data_ptr(),
                                     keys.stride(0), blocks.contiguous().data_ptr(), length, context, heads,
                                     kv_heads, d, block_size, scale, window, out[start:].data_ptr(), out.stride(0),
                                     kv_half(keys), _threads())
    if rc:
        raise {-1: MemoryError(f"bfloat16 attention of {length} rows over {context} tokens: out of memory"),
               -2: RuntimeError("this build has no AVX-512 BF16")}.get(rc, ValueError(f"head size {d}: not a multiple of 64"))


def int4_dequantize(qs: torch.Tensor, dm: torch.Tensor, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
    """Rows [start, stop) of an int4 weight (`engine.quant.Int4Weight`) as float32 into `out` [stop - start, k],
    in one pass."""
    library().tq_int4_dequant(qs.data_ptr(), dm.data_ptr(), out.shape[1], start, stop, out.data_ptr(), _threads())
    return out


KINDS = {"int4": 4, "q8_0": 8}  # weight kinds tq_decoder_layer multiplies (engine.quant's kind -> ops.c's)
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
    n = w.shape[0]
    k = w.shape[1] * (2 if kind == "int4" else 1)
    return Linear(KINDS[kind], w.data_ptr(), scales.data_ptr(), n, k)


def layer(attn_norm: torch.Tensor, ffn_norm: torch.Tensor, wqkv: Linear, wo: Linear, gate_up: Linear,
          down: Linear) -> Layer:
    return Layer(attn_norm.data_ptr(), ffn_norm.data_ptr(), wqkv, wo, gate_up, down)


class LayerStep:
    """The buffers and row metadata of one forward pass that runs each layer as one `tq_decoder_layer` call:
    `h` [m, hidden] (the residual stream, updated in place) and `pending` (the last layer's MLP output, which
    the caller adds to h)."""

    def __init__(self, h: torch.Tensor, first: Layer, positions: torch.Tensor, blocks: torch.Tensor,
                 offsets: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                 keys: torch.Tensor, tables: torch.Tensor, row_table: torch.Tensor, lens: torch.Tensor, eps: float,
                 scale: float):
        m, hidden = h.shape
        _, block_size, _, d = keys.shape
        width, ffn = first.wqkv.n, first.gate_up.n // 2
        self.buffers = {name: torch.empty(m, cols, dtype=torch.float32) for name, cols in (
            ("res", hidden), ("x", hidden), ("qkv", width), ("attn", heads * d), ("gu", 2 * ffn), ("act", ffn))}
        self._keep = (h, positions, blocks, offsets, cos, sin, tables, row_table, lens)
        b = self.buffers
        self.s = _LayerStep(m, hidden, heads * d, width, ffn, h.data_ptr(), *(b[k].data_ptr() for k in b),
                            positions.data_ptr(), blocks.data_ptr(), offsets.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                            heads, kv_heads, d, block_size, keys.stride(0), tables.data_ptr(), row_table.data_ptr(),
                            lens.data_ptr(), tables.stride(0), eps, scale, 0, _threads(), kv_half(keys))

    def run(self, layer: Layer, keys: torch.Tensor, values: torch.Tensor) -> None:
        if library().tq_decoder_layer(ctypes.byref(layer), ctypes.byref(self.s), keys.data_ptr(), values.data_ptr()):
            raise MemoryError(f"decoder layer of {self.s.m} rows: out of memory")

    @property
    def pending(self) -> torch.Tensor:
        return self.buffers["res"]
