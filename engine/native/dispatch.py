"""Which build of the C (``csrc/``) this process runs, and which kernel path: chosen once, at start-up, from the CPU's
features (``engine.native.build.VARIANTS``), what is installed, and ``TANDEM_NATIVE`` / ``TANDEM_KERNELS``.

The library is loaded with ctypes and refused when it was built from other C (its source hash); the
kernel path is the fastest this CPU and build have unless one is named (`kernel_path` says what each does).
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

from engine.native.build import VARIANTS, Variant, cpu_flags, source_hash

log = logging.getLogger("tandem.native")

KINDS = {"int4": 4, "q8_0": 8}  # weight kinds tq_decoder_layer multiplies (engine.quant's kind -> the C's)
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "tq_source_hash": [],
    "tq_rms_norm": [_P, _P, _P, _I, _I, _F, _P, _C],
    "tq_silu_mul": [_P, _I, _I, _P, _C],
    "tq_argmax": [_P, _I, _I, _P, _C],
    "tq_q8_rows": [_P, _P, _I, _I, _P, _I, _P],
    "tq_rope_store": [_P, _I, _I, _P, _P, _P, _C, _C, _C, _P, _P, _I, _P, _P, _C, _C],
    "tq_paged_attention": [_P, _I, _P, _P, _I, _P, _I, _P, _P, _I, _C, _C, _C, _C, _F, _I, _P, _C, _C],
    "tq_q8_matmul": [_P, _P, _I, _I, _P, _I, _P, _C],
    "tq_q4_matmul": [_P, _P, _I, _I, _P, _I, _P, _C],
    "tq_int4_dequant": [_P, _P, _I, _I, _I, _P, _C],
    "tq_decoder_layers": [_P, _I, _I, _P, _P, _P],
    "tq_panel_min_rows": [_C],
    "tq_set_row_invariant": [_C],
    "tq_has_bf16": [],
    "tq_bf16_matmul": [_C, _P, _P, _I, _I, _P, _I, _P, _C],
    "tq_has_i8": [],
    "tq_i8_packed_bytes": [_C, _I, _I],
    "tq_i8_pack": [_C, _P, _P, _I, _I, _P, _C],
    "tq_i8_matmul": [_C, _P, _I, _I, _P, _I, _P, _C, _C],
    "tq_has_chunk_attention": [],
    "tq_chunk_attention": [_P, _I, _P, _P, _I, _P, _I, _I, _C, _C, _C, _C, _F, _I, _P, _I, _C, _C, _C],
    "tq_probe_fma": [_I, _C],
    "tq_probe_bf16": [_I, _C],
    "tq_probe_vnni": [_I, _C],
    "tq_probe_read": [_P, _I, _C],
}
RETURNS = {"tq_source_hash": ctypes.c_char_p, "tq_q8_matmul": ctypes.c_int, "tq_q4_matmul": ctypes.c_int,
           "tq_decoder_layers": ctypes.c_int, "tq_q8_rows": ctypes.c_int, "tq_panel_min_rows": ctypes.c_int64,
           "tq_has_bf16": ctypes.c_int, "tq_bf16_matmul": ctypes.c_int, "tq_chunk_attention": ctypes.c_int,
           "tq_has_chunk_attention": ctypes.c_int,
           "tq_has_i8": ctypes.c_int, "tq_i8_matmul": ctypes.c_int, "tq_i8_packed_bytes": ctypes.c_int64,
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
            raise OSError(f"the {wanted} build of engine/native/csrc is not installed")
        return variant, path
    runnable = [v for v in VARIANTS if v.runs_on(flags)]
    built = [(v, path) for v in runnable if (path := variant_file(v)) is not None]
    if not built:
        raise OSError("no build of engine/native/csrc is installed for this CPU (a compiler was missing at "
                      "install time?)")
    if built[0][0] is not runnable[0]:
        log.warning("engine.native: the %s build is not installed; using the %s build", runnable[0].name,
                    built[0][0].name)
    return built[0]


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib`'s functions with the argument and return types this tree's C has (`SIGNATURES`, `RETURNS`); a
    function a library lacks is left out (a library built from other C: its source hash says so next)."""
    for name, args in SIGNATURES.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, RETURNS.get(name)
    return lib


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
    declare(lib)
    built_from = lib.tq_source_hash().decode()
    if built_from != source_hash():
        log.warning("engine.native: %s was built from other C (rebuild it: pip install -e . or python "
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
    """Which build of the C this process runs (`engine.native.build.VARIANTS`), or ``none``."""
    return _variant[0] if library() is not None else "none"


def available() -> bool:
    return library() is not None


INVARIANT = "invariant"
VNNI = "avx512_vnni"  # every row on int8 dot products of packed weights (`engine.native.i8_matmul`)
DOTPROD = "neon_dotprod"  # the same on ARM's int8 dot product (the same bits)
I8_PATHS = {1: VNNI, 2: DOTPROD}  # csrc tq_has_i8() -> the path of its int8 panels
#: every path a build can have; see kernel_path
KERNEL_PATHS = (VNNI, DOTPROD, "avx512_bf16", "avx2", "portable", INVARIANT)
_chosen = ["torch"]
_variant = ["none"]


def _paths(lib: ctypes.CDLL) -> list[str]:
    simd = ["avx2"] if lib.tq_panel_min_rows(KINDS["int4"]) < 2**62 else ["portable"]
    i8 = [I8_PATHS[lib.tq_has_i8()]] if lib.tq_has_i8() else []
    if lib.tq_has_bf16():
        bf16 = [*i8, "avx512_bf16"]
        simd = [*bf16, *simd] if _bf16_pays(lib) else [*simd, *bf16]
    else:
        simd = [*i8, *simd]
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
    """How this process multiplies int4/Q8_0 weights: ``avx512_vnni`` (every row on int8 dot products of the weights
    packed at load, `native.i8_matmul`: decode rows and short chunks with 15-bit activations, long prompt chunks with
    8-bit ones and their attention in bfloat16 where the build has AVX-512 BF16), ``neon_dotprod`` (the same panels
    and bits on ARM's int8 dot product; long chunks attend in torch's SDPA), ``avx512_bf16`` (long prompt chunks and
    their attention on bfloat16 panels, everything else as ``avx2``), ``avx2`` (int16 activations and float32
    panels; long chunks dequantized for a float32 GEMM), ``portable`` (the C for the compiler's default target:
    scalar on x86, the int16 kernels in NEON on aarch64), ``invariant`` (every row on the int16 kernels and the C
    attention, whatever its step holds: a row's bits never depend on its batch; chosen only when asked for) or
    ``torch`` (no native library). The fastest the CPU has (`kernel_paths`) is chosen at start-up, or the one
    ``TANDEM_KERNELS`` (``--kernels``) names."""
    return _chosen[0] if library() is not None else "torch"


#: kernel path -> what its long prompt chunks' matmuls multiply in, on panels of the compact weights (the paths not
#: named dequantize the weights for a float32 GEMM)
PANEL_PRECISION = {VNNI: "int8", DOTPROD: "int8", "avx512_bf16": "bfloat16"}


def packs_i8(path: str | None = None) -> bool:
    """Whether kernel path `path` (default: this process's) multiplies every row on the int8 panels of weights packed
    at load (`engine.native.i8_pack`)."""
    return (path or kernel_path()) in I8_PATHS.values()


def bf16_attention_paths() -> list[str]:
    """The kernel paths here whose long prompt chunks attend in bfloat16: those with panels, where the build has
    AVX-512 BF16 (avx512_vnni without it, on Cascade Lake or Ice Lake, attends in float32)."""
    lib = library()
    if lib is None or not lib.tq_has_bf16():
        return []
    return [p for p in PANEL_PRECISION if p in _paths(lib)]


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
