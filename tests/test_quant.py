"""Quantized weights against the dequantized GGUF reference, for every GGUF type the loader takes.

Tiny tensors are written with `gguf.GGUFWriter` (K-quant blocks are filled with random codes, since
gguf-py cannot quantize to them), read back like a model file and encoded in each `--quantization`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from engine.linear_paths import KERNELS
from engine.loader import GGUFWeights
from engine.native import Workspace
from engine.quant import (
    FP16Weight,
    Int4Weight,
    Int8Weight,
    Q8Weight,
    fp16_supported,
    weight_from_tensors,
)
from tests.harness.native import NEEDS_NATIVE, PANEL_TOLERANCE, ROUNDED_TILE_ROWS
from tests.harness.reference_models import finish_gguf

ROWS, COLS = 96, 256
BLOCK_BYTES = {Q.Q4_K: 144, Q.Q6_K: 210}


def k_quant_blocks(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with sane float16 scales (where the block keeps its d / dmin)."""
    raw = rng.integers(0, 256, size=(ROWS, COLS // 256 * BLOCK_BYTES[qtype]), dtype=np.uint8)
    blocks = raw.reshape(ROWS, -1, BLOCK_BYTES[qtype])
    scales = rng.uniform(0.001, 0.01, size=blocks.shape[:2] + (2,)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:  # d, dmin first
        blocks[..., 0:4] = scales.reshape(*blocks.shape[:2], 4)
    else:  # Q6_K: d last
        blocks[..., -2:] = scales.reshape(*blocks.shape[:2], 4)[..., :2]
    return raw


@pytest.fixture(scope="module")
def gguf_tensors(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("quant") / "tiny.gguf"
    w = GGUFWriter(str(path), "llama")
    floats = (rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32)
    for qt in (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        if qt == Q.F32:
            w.add_tensor(f"w.{qt.name}", floats)
        else:
            w.add_tensor(f"w.{qt.name}", quantize(floats, qt), raw_dtype=qt)
    for qt in BLOCK_BYTES:
        w.add_tensor(f"w.{qt.name}", k_quant_blocks(qt, rng), raw_dtype=qt)
    finish_gguf(w)
    return {t.name: t for t in GGUFReader(str(path)).tensors}


def reference(t) -> torch.Tensor:
    return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(ROWS, COLS))


TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"]
# (mode, GGUF type) -> the kind the loader must choose
EXPECTED = {"auto": {"F32": "none", "F16": "none", "BF16": "none", "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4",
                     "Q8_0": "q8_0", "Q5_0": "q8_0", "Q5_1": "q8_0", "Q6_K": "q8_0"}}
EXACT_Q8 = ("Q8_0", "Q5_0", "Q4_0")  # codes that fit int8 with the block's own scale


def expected_kind(mode: str, qtype: str) -> str:
    if mode == "auto":
        return EXPECTED["auto"][qtype]
    return mode


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("mode", ["auto", "none", "fp16", "int8", "int4"])
def test_quantized_matmul_matches_the_dequantized_gguf_tensor(gguf_tensors, qtype, mode):
    t = gguf_tensors[f"w.{qtype}"]
    ref = reference(t)
    g = GGUFWeights("tiny.gguf", gguf_tensors, mode, "float32")
    weight = weight_from_tensors(g.weight("w", [(t.name, 0)]), "w", Workspace(torch.device("cpu")))
    kind = expected_kind(mode, qtype)
    assert g.kinds == {kind}
    assert weight.kind == (kind if kind != "fp16" or fp16_supported() else "none")
    # Storage error: none for the GGUF's own int4 and Q8_0 blocks (and Q5_0's, as Q8_0); Q4_K's float16 sub-scales
    # cost 2^-11 of a scale; re-quantizing to Q8_0 half a step of 1/127 of a group's largest; to int4 more.
    tol = {"none": 1e-6, "fp16": 2e-3, "int8": 1e-2, "q8_0": 1e-6 if qtype in EXACT_Q8 else 4e-3,
           "int4": 1e-6 if qtype in ("Q4_0", "Q4_1") else 1e-3 if qtype == "Q4_K" else 0.15}[kind]
    scale = ref.abs().max()
    assert (weight.dequantize() - ref).abs().max() <= tol * scale
    g2 = torch.Generator().manual_seed(1)
    for rows, dequant_rows in ((1, 0), (5, 0), (80, 80), (80, 30)):  # kernel, kernel, dequantize path, split
        x = torch.randn(rows, COLS, generator=g2)
        want = x @ ref.T
        got = weight(x, dequant_rows).float()
        err = (got - want).abs().max() / want.abs().max()
        assert err < tol + 1e-2, (rows, dequant_rows, err.item())


def test_gguf_int4_codes_are_the_files_values_exactly(gguf_tensors):
    """Q4_0/Q4_1 become int4 with the file's codes and float16 (d, m): dequantizing gives the GGUF values."""
    from engine.loader import _q4_codes

    for qtype in ("Q4_0", "Q4_1"):
        t = gguf_tensors[f"w.{qtype}"]
        w = Int4Weight.from_codes(*_q4_codes(t, 0))
        assert torch.allclose(w.dequantize(), reference(t), rtol=1e-6, atol=1e-7)
        assert torch.equal(w.codes(), _q4_codes(t, 0)[0])


def assert_rows_independent(w, x: torch.Tensor, split: int) -> None:
    """Row r of w(x[a:b]) is row r of w(x) whenever b - a and len(x) are on the same side of `split`."""
    full, few = w(x), w(x[: split - 1])
    for start, stop in ((0, 1), (3, 4), (5, 12)):
        assert torch.equal(w(x[start:stop].clone()), few[start:stop])
    for start, stop in ((len(x) - split, len(x)), (2, split + 2)):
        assert torch.equal(w(x[start:stop].clone()), full[start:stop])


def panel_split(kind: str) -> int:
    """Where `kind`'s kernels switch to float32 panels; where they never do (no library; kernel paths invariant and
    avx512_vnni), any split inside the tests' 40 rows checks that."""
    from engine import native

    return min(native.panel_min_rows(kind), 36) if native.available() else 36


@pytest.mark.parametrize("cls", [Int4Weight, Int8Weight])
def test_kernel_rows_do_not_depend_on_the_other_rows(cls):
    """A row gets the same bits alone and inside any batch on its side of the int4 kernel's switch to float32
    panels (Int8Weight, torch's kernel, has one side)."""
    w = cls.quantize(torch.randn(96, 128) * 0.05)
    split = panel_split("int4") if cls is Int4Weight else 16
    assert_rows_independent(w, torch.randn(40, 128), split)


@pytest.mark.parametrize("cls", [Int4Weight, Int8Weight])
def test_embedding_rows_are_the_dequantized_rows(cls):
    w = cls.quantize(torch.randn(96, 128) * 0.05)
    ids = torch.tensor([0, 95, 33, 33, 64])
    assert torch.equal(w.rows(ids), w.dequantize()[ids])


def test_dequantize_path_splits_large_outputs_into_chunks(monkeypatch):
    from engine import linear_paths, native

    if native.kernel_path() in ROUNDED_TILE_ROWS:  # long rows go to panels of the compact weights there
        monkeypatch.setattr(native.dispatch, "_chosen", ["avx2"])
    monkeypatch.setattr(linear_paths, "_DEQUANT_ROWS", 64)  # 96 output rows: two chunks
    w = Int4Weight.quantize(torch.randn(96, 128) * 0.05, Workspace(torch.device("cpu")))
    x = torch.randn(7, 128)
    assert torch.allclose(w(x, dequant_rows=7), x @ w.dequantize().T, atol=1e-4)


@pytest.mark.skipif(not fp16_supported(), reason="fbgemm's float16 GEMM is x86 only")
def test_fp16_weight_is_float32_arithmetic_on_half_weights():
    w16 = (torch.randn(64, 128) * 0.05).half()
    w = FP16Weight(w16)
    x = torch.randn(9, 128)
    assert torch.allclose(w(x), x @ w16.float().T, atol=1e-5)


def test_kernel_choice_defaults_are_sane():
    assert 1 <= KERNELS.kernel_max_chunk <= KERNELS.lm_head_kernel_max_rows


def q8_weight(rows: int = 96, cols: int = 128) -> Q8Weight:
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int8)
    return Q8Weight(q, (torch.rand(rows, cols // 32, generator=g) * 1e-3).half().view(torch.int16))


@NEEDS_NATIVE
def test_q8_0_kernel_is_the_files_blocks_times_16_bit_activations():
    """Q8_0 kept as the file's blocks: the kernel gives x @ W.T in float32 (below `panel_min_rows` with
    activations rounded to int16 per group of 32: relative error ~1e-5, where int8 activations were ~1e-2), a
    row the same bits alone and inside any batch on its side of that switch, and embedding rows are the
    dequantized rows."""
    w = q8_weight()
    split = panel_split("q8_0")
    x = torch.randn(max(40, split + 8), 128)
    for rows in (1, 5, split - 1, split, x.shape[0]):
        got, want = w(x[:rows]), x[:rows] @ w.dequantize().T
        assert got.dtype == torch.float32
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), rows
    assert_rows_independent(w, x, split)
    ids = torch.tensor([0, 95, 33, 33, 64])
    assert torch.equal(w.rows(ids), w.dequantize()[ids])


@NEEDS_NATIVE
def test_int4_kernel_is_the_codes_times_16_bit_activations():
    """The int4 kernel (GGUF Q4 blocks against activations rounded to int16 per group of 32, or, from
    `panel_min_rows` rows on, dequantized to float32 panels) is x @ W.T to ~1e-5 relative, for one row and
    for tiles of many."""
    odd = Int4Weight.quantize(torch.randn(64, 256) * 0.05)
    for w in (Int4Weight.quantize(torch.randn(96, 256) * 0.05), Int4Weight.quantize(torch.randn(64, 1536) * 0.05),
              Int4Weight(odd.qs[:33], odd.dm[:33])):  # an odd number of rows: batch 1's 1 x 2 tiles end with one
        n, k = w.out_features, w.in_features
        for rows in (1, 3, 4, 9, 15, 16, 23, 40):  # both sides of panel_min_rows("int4"), and the panels' tail tiles
            x = torch.randn(rows, k)
            want = x @ w.dequantize().T
            assert (w(x) - want).abs().max() <= 1e-4 * want.abs().max(), (n, k, rows)


@pytest.mark.parametrize("cls", [Int4Weight, Q8Weight])
def test_long_chunk_rows_on_each_kernel_path(cls, kernel_path):
    """A long prompt chunk's rows (`dequant_rows`) are x @ W.T on every kernel path: float32 GEMM of the
    dequantized weights, or (avx512_bf16, avx512_vnni) panels of the compact ones to their rounding (bfloat16, int8
    activations), and there a row computes the same bits in a chunk of any length (12- or 6-row tiles, tails of
    every height below, a partial panel)."""
    w = cls.quantize(torch.randn(96, 576) * 0.05) if cls is Int4Weight else q8_weight(50, 576)  # Q8: a partial panel
    x = torch.randn(150, 576)
    got, want = w(x, dequant_rows=150), x @ w.dequantize().T
    assert (got - want).abs().max() <= PANEL_TOLERANCE.get(kernel_path, 1e-2) * want.abs().max()
    split = w(x, dequant_rows=100)  # the first 100 rows a long chunk, the rest on the kernel, into one output
    rest, alone = split[100:], w(x[100:])
    if kernel_path == "torch":  # torch's kernels: int4 in bfloat16, Q8_0 re-quantized per channel
        assert (rest - alone).abs().max() <= 2e-2 * alone.abs().max()
    else:
        assert torch.equal(rest, alone)
    assert torch.equal(split[:100], w(x[:100], dequant_rows=100))
    if kernel_path in ROUNDED_TILE_ROWS:
        assert (got - want).abs().max() > 1e-6 * want.abs().max()  # it did run rounded
        tile = ROUNDED_TILE_ROWS[kernel_path]
        for start, stop in [(0, 1), (7, 20), (137, 150)] + [(r, tile + 2 * r) for r in range(1, tile)]:
            assert torch.equal(w(x[start:stop], dequant_rows=stop - start), got[start:stop]), (start, stop)


@pytest.mark.parametrize("cls", [Int4Weight, Q8Weight])
def test_any_number_of_threads_computes_the_same_bits(cls, kernel_path):
    """Each thread starts on its own range of a matmul's tiles or panels and, once done, takes chunks from the back
    of the others' (csrc/threads.c `share_next`). With more threads than cores some are preempted and their chunks taken
    by others: every output must still be computed once, the same way, so 1 to 4 threads give the same bits, again
    and again (batch 1's 1 x 2 tiles, R x 1 tiles, float32 panels, and a long chunk's bfloat16 or int8 panels)."""
    if kernel_path == "torch":
        pytest.skip("torch's kernels: their threads are torch's business")
    w = cls.quantize(torch.randn(224, 576) * 0.05) if cls is Int4Weight else q8_weight(200, 576)
    shapes = [(1, 0), (5, 0), (40, 0)] + ([(40, 40)] if kernel_path in ROUNDED_TILE_ROWS else [])
    before = torch.get_num_threads()
    try:
        for rows, dequant_rows in shapes:
            x = torch.randn(rows, 576)
            torch.set_num_threads(1)
            want = w(x, dequant_rows)
            for threads in (2, 3, 4):
                torch.set_num_threads(threads)
                for _ in range(10):
                    assert torch.equal(w(x, dequant_rows), want), (rows, dequant_rows, threads)
    finally:
        torch.set_num_threads(before)
