"""engine.native's C operations against the torch operations they replace (which are also the fallback)."""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from engine import native
from engine.native import dispatch
from engine.rope import apply_rope
from tests.harness.chat import chat_ids
from tests.harness.native import kernel_paths

pytestmark = pytest.mark.skipif(not native.available(), reason="engine.native is not built here: the torch operations run instead")

HEADS, KV_HEADS, D, BLOCK = 9, 3, 64, 16


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("n", [576, 100, 7])
def test_rms_norm_matches_torch(rows, n):
    """RMSNorm, with the residual added in place first or not, is torch's at any width (the AVX-512 loop's masked
    tail: 100, 7) and row count (40 rows: both threads)."""
    x, w, residual = torch.randn(rows, n), torch.randn(n), torch.randn(rows, n)
    assert torch.allclose(native.rms_norm(x, w, 1e-5), F.rms_norm(x, (n,), w, 1e-5), atol=1e-5, rtol=1e-5)
    summed = x + residual
    got = native.rms_norm(x, w, 1e-5, residual)
    assert torch.equal(x, summed)
    assert torch.allclose(got, F.rms_norm(summed, (n,), w, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("f", [1536, 24, 5])
def test_silu_mul_matches_torch_and_its_rows_alone(f):
    """silu(gate) * up is torch's for any width (AVX-512, AVX2 and scalar tails), for gates far past where e^x
    overflows either way, and each row's bits are the same computed alone."""
    gu = torch.randn(40, 2 * f) * 4
    gu[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    got = native.silu_mul(gu)
    assert torch.allclose(got, F.silu(gu[:, :f]) * gu[:, f:], atol=1e-5, rtol=1e-5)
    assert torch.equal(native.silu_mul(gu[7:8].clone())[0], got[7])


def _pool(blocks: int = 40, d: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's key and value views of a pool laid out as kv.pool's: [blocks, layers, 2, block, kv_heads, d]."""
    pool = torch.randn(blocks, 4, 2, BLOCK, KV_HEADS, d)
    return pool[:, 2, 0], pool[:, 2, 1]


def test_the_c_calls_refuse_tensors_they_would_misread():
    """ctypes passes addresses only: a tensor of another dtype, device or layout, or a weight that does not fit the
    rows, is refused with a ValueError naming it (it used to be read as whatever bytes were there)."""
    from engine.quant import Int4Weight

    x, w = torch.randn(6, 64), torch.randn(64)
    int4 = Int4Weight.quantize(torch.randn(32, 64) * 0.05)
    kc, vc = _pool()
    tables, row_table, lens = torch.zeros(2, 4, dtype=torch.long), torch.tensor([0, 1]), torch.tensor([5, 9])
    q = torch.randn(2, HEADS * D)
    for call, what in [
        (lambda: native.rms_norm(x.double(), w, 1e-5), "rms_norm's rows must be a CPU tensor of float32"),
        (lambda: native.rms_norm(x.t().contiguous().t(), w, 1e-5), "contiguous"),
        (lambda: native.rms_norm(x.to("meta"), w, 1e-5), "on meta"),
        (lambda: native.rms_norm(x, torch.randn(65), 1e-5), "weight"),
        (lambda: native.silu_mul(torch.randn(6, 128)[:, ::2]), "silu_mul's rows must be contiguous"),
        (lambda: native.q4_matmul(torch.randn(3, 128), int4.qs, int4.dm), "does not take rows of 128"),
        (lambda: native.q4_matmul(x, int4.qs.view(torch.int8), int4.dm), "int4 codes must be a CPU tensor of uint8"),
        (lambda: native.q4_matmul(x, int4.qs, int4.dm.float()), "int4 scales"),
        (lambda: native.paged_attention(q, kc, vc, tables.int(), row_table, lens, HEADS, 0.3), "block tables"),
        (lambda: native.paged_attention(q, kc, vc.contiguous(), tables, row_table, lens, HEADS, 0.3), "laid out alike"),
        (lambda: native.paged_attention(q, kc, vc, tables, row_table[:1], lens, HEADS, 0.3), "row_table"),
    ]:
        with pytest.raises(ValueError, match=what):
            call()
    wide = torch.randn(2, HEADS * D + 2 * KV_HEADS * D)  # qkv rows: the query heads are a row-strided view
    assert torch.equal(native.paged_attention(wide[:, :HEADS * D], kc, vc, tables, row_table, lens, HEADS, 0.3),
                       native.paged_attention(wide[:, :HEADS * D].clone(), kc, vc, tables, row_table, lens, HEADS, 0.3))


def test_a_layer_stack_checks_its_pools_views_once_and_refuses_what_it_would_misread(smollm, monkeypatch):
    """`tq_decoder_layers` takes arrays of addresses: a stack checks the pool's K/V views (one per layer, laid out
    alike) when it first meets them, keeps the arrays while the views are the same, and a step refuses layers
    outside the stack."""
    from engine.engine import EngineConfig, LLMEngine
    from engine.params import SamplingParams

    engine = LLMEngine(smollm, EngineConfig(num_blocks=16, enable_prefix_cache=False))
    stack = engine.model.fused_layers()
    assert stack is not None
    keys, values = engine.pool.layer_views()
    layout = (keys[0].stride(), keys[0].dtype)
    first = stack.pool_addresses(keys, values, layout)
    assert stack.pool_addresses(keys, values, layout) is first  # the same views: the same arrays
    assert [first[0][i] for i in range(len(keys))] == [k.data_ptr() for k in keys]
    with pytest.raises(ValueError, match="value views for 30 layers"):
        stack.pool_addresses(list(keys), list(values[:-1]), layout)
    with pytest.raises(ValueError, match="unlike the step's"):
        stack.pool_addresses(list(keys), [v.contiguous() for v in values], layout)
    steps = []
    real = native.LayerStep
    monkeypatch.setattr(native, "LayerStep", lambda *a: steps.append(real(*a)) or steps[-1])
    engine.generate([chat_ids(smollm, "Hi")], SamplingParams(max_tokens=2, temperature=0.0))
    for first_layer, last_layer in ((0, 31), (-1, 3), (5, 5)):
        with pytest.raises(ValueError, match="of a stack of 30"):
            steps[-1].run(stack, keys, values, first_layer, last_layer)


def test_rope_store_rotates_q_and_k_and_writes_k_and_v_to_their_slots():
    kc, vc = _pool()
    n, width = 5, (HEADS + 2 * KV_HEADS) * D
    qkv = torch.randn(n, width)
    positions = torch.tensor([0, 3, 77, 150, 151])
    blocks, offsets = torch.tensor([4, 9, 2, 30, 30]), torch.tensor([3, 13, 6, 0, 1])
    angles = torch.outer(torch.arange(200.0), 1.0 / 10000 ** (torch.arange(0, D, 2) / D))
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    got = qkv.clone()
    native.rope_store(got, positions, cos, sin, HEADS, KV_HEADS, kc, vc, blocks, offsets)
    qk = apply_rope(qkv[:, : (HEADS + KV_HEADS) * D].view(n, -1, D), cos[positions].unsqueeze(1),
                    sin[positions].unsqueeze(1))
    assert torch.allclose(got[:, : (HEADS + KV_HEADS) * D], qk.reshape(n, -1), atol=1e-5)
    assert torch.equal(got[:, (HEADS + KV_HEADS) * D:], qkv[:, (HEADS + KV_HEADS) * D:])  # v untouched
    assert torch.equal(kc[blocks, offsets], got[:, HEADS * D:(HEADS + KV_HEADS) * D].view(n, KV_HEADS, D))
    assert torch.equal(vc[blocks, offsets], qkv[:, (HEADS + KV_HEADS) * D:].view(n, KV_HEADS, D))


@pytest.mark.parametrize("d", [64, 40, 120, 128, 12])  # value sums of 64, 32, 16 and 8 floats; 12: no vectors
def test_a_float16_pool_attends_as_float32_holding_the_same_values(d):
    """A float16 KV pool (`--kv-dtype float16`: half the bytes a decode step reads) computes the same bits as a
    float32 pool holding those values: its elements are widened exactly before the same float32 arithmetic.
    rope_store writes each k and v rounded to nearest even, as torch's .half()."""
    _float16_pool_attends_as_float32(d)


def _float16_pool_attends_as_float32(d: int) -> None:
    kc, vc = _pool(d=d)
    kh, vh = kc.half(), vc.half()
    g = torch.Generator().manual_seed(1)
    tables = torch.stack([torch.randperm(40, generator=g)[:8] for _ in range(3)])
    row_table, lens = torch.tensor([0, 1, 2, 2]), torch.tensor([33, 128, 70, 3])
    q = torch.randn(4, HEADS * d, generator=g)
    for window in (0, 20):
        want = native.paged_attention(q, kh.float(), vh.float(), tables, row_table, lens, HEADS, 0.3, window)
        got = native.paged_attention(q, kh, vh, tables, row_table, lens, HEADS, 0.3, window)
        assert torch.equal(got, want), window
    n, width = 5, (HEADS + 2 * KV_HEADS) * d
    qkv = torch.randn(n, width, generator=g)
    positions, blocks, offsets = torch.arange(n), torch.tensor([4, 9, 2, 30, 30]), torch.tensor([3, 13, 6, 0, 1])
    angles = torch.outer(torch.arange(8.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos, sin = torch.cat([angles.cos(), angles.cos()], -1), torch.cat([-angles.sin(), angles.sin()], -1)
    as32, as16 = qkv.clone(), qkv.clone()
    native.rope_store(as32, positions, cos, sin, HEADS, KV_HEADS, kc, vc, blocks, offsets)
    native.rope_store(as16, positions, cos, sin, HEADS, KV_HEADS, kh, vh, blocks, offsets)
    assert torch.equal(as16, as32)  # q, k and v rows themselves stay float32
    assert torch.equal(kh[blocks, offsets], kc[blocks, offsets].half())
    assert torch.equal(vh[blocks, offsets], vc[blocks, offsets].half())
    with pytest.raises(ValueError, match="float32 or float16"):
        native.paged_attention(q, kc.bfloat16(), vc.bfloat16(), tables, row_table, lens, HEADS, 0.3)


@pytest.mark.parametrize("d", [64, 40, 120, 128])  # the value sums run 64, 32, 16 and 8 floats at a time
def test_paged_attention_matches_sdpa_over_each_sequences_own_blocks(d):
    """Decode rows (one query each) and a prompt chunk's rows (causal, after cached tokens) in one call."""
    kc, vc = _pool(d=d)
    g = torch.Generator().manual_seed(0)
    tables = torch.stack([torch.randperm(40, generator=g)[:8] for _ in range(4)])
    # rows 0-2: a chunk of sequence 0 at positions 30..32 (30 cached); rows 3-6: decode rows of sequences 1-3
    # and 0 again with a context of 1
    row_table = torch.tensor([0, 0, 0, 1, 2, 3, 0])
    lens = torch.tensor([31, 32, 33, 70, 1, 128, 1])
    qkv = torch.randn(len(lens), (HEADS + 2 * KV_HEADS) * d)
    q = qkv[:, : HEADS * d]  # strided rows, as the model passes them
    got = native.paged_attention(q, kc, vc, tables, row_table, lens, HEADS, 1 / math.sqrt(d))
    for r, (seq, length) in enumerate(zip(row_table.tolist(), lens.tolist())):
        ks = kc[tables[seq]].flatten(0, 1)[:length].transpose(0, 1).unsqueeze(0)
        vs = vc[tables[seq]].flatten(0, 1)[:length].transpose(0, 1).unsqueeze(0)
        want = F.scaled_dot_product_attention(q[r].view(1, HEADS, 1, d), ks, vs, enable_gqa=True)
        assert torch.allclose(got[r], want.reshape(-1), atol=1e-5), r
    # a row's result does not depend on the other rows of its call (7 rows: a row's KV heads are one work item;
    # 1 row: each KV head is one): a prompt row equals the same decode row
    alone = native.paged_attention(q[1:2].clone(), kc, vc, tables[:1].clone(), torch.tensor([0]), lens[1:2].clone(),
                                   HEADS, 1 / math.sqrt(d))
    assert torch.equal(alone[0], got[1])


@pytest.mark.parametrize("d", [64, 128, 40])  # 40: not a multiple of 16, so attend_row on every build
def test_paged_attention_over_long_contexts_adds_up_its_segments(d):
    """Contexts past 128 tokens (on an AVX-512 build, each 128 tokens of a row's context is a work item, added up
    afterwards) and windows that start in a segment's middle: SDPA's result, and the same bits for a row alone or
    beside others, on one thread or two, and from a float16 pool as from float32 holding its values."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, bs = 12, 3, 16  # 4 query heads a KV head: scores in passes of 3 + 1
    lens = torch.tensor([129, 256, 300, 1000, 7, 128, 385])
    blocks = 64
    kc = torch.randn(blocks * len(lens), bs, kv_heads, d, generator=g).half()
    vc = torch.randn(blocks * len(lens), bs, kv_heads, d, generator=g).half()
    tables = torch.randperm(blocks * len(lens), generator=g).view(len(lens), blocks)
    q = torch.randn(len(lens), heads * d, generator=g)
    rows = torch.arange(len(lens))
    threads = torch.get_num_threads()
    try:
        for window in (0, 200):
            torch.set_num_threads(2)
            got = native.paged_attention(q, kc, vc, tables, rows, lens, heads, 0.2, window)
            assert torch.equal(got, native.paged_attention(q, kc.float(), vc.float(), tables, rows, lens, heads, 0.2,
                                                           window))
            torch.set_num_threads(1)
            for r in (0, 3, 6):
                alone = native.paged_attention(q[r:r + 1].clone(), kc, vc, tables, rows[r:r + 1].clone(),
                                               lens[r:r + 1].clone(), heads, 0.2, window)
                assert torch.equal(alone[0], got[r]), (window, r)
            for r, n in enumerate(lens.tolist()):
                lo = max(0, n - window) if window else 0
                ks = kc[tables[r]].flatten(0, 1)[lo:n].float().transpose(0, 1).unsqueeze(0)
                vs = vc[tables[r]].flatten(0, 1)[lo:n].float().transpose(0, 1).unsqueeze(0)
                want = F.scaled_dot_product_attention(q[r].view(1, heads, 1, d), ks, vs, scale=0.2, enable_gqa=True)
                assert torch.allclose(got[r], want.reshape(-1), atol=1e-5), (window, n)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("d", [64, 12])  # the vector path and the portable one (d not a multiple of 8)
def test_windowed_paged_attention_sees_only_the_last_window_tokens(d):
    """A sliding-window layer's rows (window 20, not a multiple of the 16-token block) over contexts of 1 to 100
    tokens, some starting mid-block: each row equals SDPA over its own last 20 tokens, gathered from the pool."""
    torch.manual_seed(3)
    heads, kv_heads, bs, window = 4, 2, 16, 20
    lens = torch.tensor([1, 19, 20, 21, 37, 64, 100])
    blocks = 8
    kc, vc = torch.randn(2 * blocks + 4, bs, kv_heads, d), torch.randn(2 * blocks + 4, bs, kv_heads, d)
    tables = torch.stack([torch.randperm(2 * blocks + 4)[:blocks] for _ in lens])
    q = torch.randn(len(lens), heads * d)
    got = native.paged_attention(q, kc, vc, tables, torch.arange(len(lens)), lens, heads, 0.3, window)
    for r, n in enumerate(lens.tolist()):
        ks = kc[tables[r]].flatten(0, 1)[max(0, n - window):n]
        vs = vc[tables[r]].flatten(0, 1)[max(0, n - window):n]
        want = F.scaled_dot_product_attention(q[r].view(1, heads, 1, d), ks.transpose(0, 1).unsqueeze(0),
                                              vs.transpose(0, 1).unsqueeze(0), scale=0.3, enable_gqa=True)
        assert torch.allclose(got[r], want.reshape(-1), atol=1e-5), (d, n)


def test_q8_rows_are_torchs_dequantized_rows_bit_for_bit_and_refuse_ids_past_the_weight():
    """The embedding lookup of a Q8_0 weight: q[ids] * the group's float16 scale, as torch computes it."""
    from engine.quant import Q8Weight

    g = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (300, 576), dtype=torch.int8, generator=g)
    scales = (torch.rand(300, 576 // 32, generator=g) * 0.02 - 0.01).half().view(torch.int16)
    ids = torch.tensor([7, 299, 0, 7, 150])
    torch_rows = (q.index_select(0, ids).view(len(ids), -1, 32)
                  * scales.index_select(0, ids).view(torch.float16).float().unsqueeze(-1)).view(len(ids), 576)
    assert torch.equal(native.q8_rows(q, scales, ids), torch_rows)
    assert torch.equal(Q8Weight(q, scales).rows(ids), torch_rows)
    for bad in ([300], [-1], [3, 300]):
        with pytest.raises(IndexError):
            native.q8_rows(q, scales, torch.tensor(bad))


def test_argmax_is_torchs_with_ties_infinities_and_nans():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 49152 + 5, generator=g)  # a tail past the last 8
    x[1, [7, 300, 49000]] = 9.0  # ties: the first
    x[2] = -math.inf
    x[3, [12, 5000]] = math.nan  # a NaN wins: the first
    x[4, -1] = 50.0  # in the tail
    x[5, :] = 0.0
    x[5, 17] = -0.0
    x[6, 49152 + 2] = math.nan
    got = native.argmax(x)
    assert got.dtype == torch.long and torch.equal(got, x.argmax(dim=-1)), (got[:8], x.argmax(dim=-1)[:8])
    assert got[1] == 7 and got[3] == 12 and got[4] == 49156
    small = torch.tensor([[1.0, 3.0, 2.0], [-1.0, -1.0, -2.0]])  # shorter than a vector
    assert native.argmax(small).tolist() == [1, 0]


def test_int4_dequantize_is_the_torch_computation_bit_for_bit(monkeypatch):
    from engine import quant

    w = quant.Int4Weight.quantize(torch.randn(96, 256) * 0.05)
    got = [w.dequantize(), w.dequantize_rows(32, 96)]
    monkeypatch.setattr(native, "available", lambda: False)
    assert torch.equal(got[0], w.dequantize())
    assert torch.equal(got[1], w.dequantize_rows(32, 96))


def test_without_the_library_int4_runs_torchs_kernel_on_the_same_codes(monkeypatch):
    from engine import quant

    w = quant.Int4Weight.quantize(torch.randn(96, 256) * 0.05)
    x = torch.randn(5, 256)
    got = w(x)
    monkeypatch.setattr(native, "available", lambda: False)
    fallback = w(x)  # torch's int4 kernel, bfloat16 activations
    assert fallback.dtype == torch.float32
    assert (fallback - got).abs().max() <= 2e-2 * got.abs().max()


def _builds() -> list[str]:
    """The installed builds of the C this CPU runs, best first."""
    from engine.native.build import VARIANTS, cpu_flags

    return [v.name for v in VARIANTS if v.runs_on(cpu_flags()) and native.variant_file(v) is not None]


@contextlib.contextmanager
def build(monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[None]:
    """This process on another build of the C (TANDEM_NATIVE), the default one back after."""
    native.library.cache_clear()
    try:
        with monkeypatch.context() as m:
            m.setenv("TANDEM_NATIVE", name)
            assert native.available() and native.variant() == name
            yield
    finally:
        native.library.cache_clear()
    assert native.available()


def test_the_install_built_the_best_variant_this_cpu_runs():
    """setup.py compiled the C per variant when the package was installed; a process takes the best one."""
    from engine.native.build import VARIANTS, cpu_flags

    best = next(v for v in VARIANTS if v.runs_on(cpu_flags()))
    assert native.variant_file(best) is not None, f"pip install -e . did not build {best.module}"
    assert native.variant() == best.name
    assert "portable" in _builds()


def test_an_arm_cpu_gets_the_dotprod_build_where_it_has_the_dot_product():
    """The variant a process loads on aarch64 (engine.native.build.VARIANTS, best first), from /proc/cpuinfo's
    Features: Cortex-A72 (no dot product) -> portable; Neoverse N1 (asimddp) -> neon_dotprod; x86 builds never."""
    from engine.native.build import VARIANTS, compile_args

    def best(flags: set[str], machine: str) -> str:
        return next(v.name for v in VARIANTS if v.runs_on(flags, machine))

    a72 = {"fp", "asimd", "evtstrm", "aes", "pmull", "sha1", "sha2", "crc32", "cpuid"}
    n1 = a72 | {"atomics", "fphp", "asimdhp", "asimdrdm", "lrcpc", "dcpop", "asimddp", "ssbs"}
    assert best(a72, "aarch64") == "portable"
    assert best(n1, "aarch64") == best(n1, "arm64") == "neon_dotprod"
    assert best(n1 | {"avx2", "fma", "f16c", "bmi2"}, "x86_64") == "avx2"  # flags alone never pick another machine's
    dotprod = next(v for v in VARIANTS if v.name == "neon_dotprod")
    assert not dotprod.builds_here("x86_64") and "-march=armv8.2-a+dotprod" in compile_args(dotprod)


def test_a_variant_that_does_not_build_leaves_no_old_library_behind(tmp_path):
    """`setup.py build_ext --inplace` (pip install -e) with a compiler that fails: the build still ends well, and
    every variant's library an earlier build left (compiled from other C, which engine.native would refuse,
    falling back to torch's operations) is gone, from the source tree and from build/."""
    import shutil
    import subprocess
    import sys
    import sysconfig

    from engine.native.build import VARIANTS

    root = pathlib.Path(__file__).parents[1]
    (tmp_path / "engine/native").mkdir(parents=True)
    for name in ("setup.py", "pyproject.toml", "engine/native/build.py"):
        shutil.copy(root / name, tmp_path / name)
    shutil.copytree(root / "engine/native/csrc", tmp_path / "engine/native/csrc")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    stale = [tmp_path / "engine/native" / f"{v.module}{suffix}" for v in VARIANTS if v.builds_here()]
    for path in stale:
        path.write_bytes(b"built from older C")
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CC": "false"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("it is left out") == len(stale), done.stderr[-2000:]
    assert not [p for p in stale if p.exists()]
    assert not list(tmp_path.glob(f"build/lib*/engine/native/*{suffix}"))


@pytest.mark.parametrize("other", _builds()[1:] or [pytest.param("portable", marks=pytest.mark.skip)])
def test_every_build_computes_what_the_best_one_does(monkeypatch, other):
    """Another build of the same C (AVX2 on an AVX-512 machine, or the portable C without SIMD: what a
    machine without those instructions loads) gives the same results to float32 rounding or, where one build
    multiplies float32 panels (many rows) and the other int16 activations, to the int16 rounding (~1e-5). Each
    build runs its avx2 path here where it has one: avx512_vnni's int8 dot products are their own test's."""
    from engine import quant

    w4 = quant.Int4Weight.quantize(torch.randn(64, 320 * 2) * 0.05)
    w8 = quant.Q8Weight(torch.randint(-127, 128, (35, 96), dtype=torch.int8),
                        (torch.rand(35, 3) * 1e-3).half().view(torch.int16))
    x4, x8 = torch.randn(40, 640), torch.randn(40, 96)

    def outputs() -> list[torch.Tensor]:
        """On the build's avx2 path where it has one (avx512_vnni's int8 panels are their own test's)."""
        here = native.kernel_path()
        native.use_kernel_path("avx2" if "avx2" in kernel_paths() else here)
        try:
            return [w4(x4[:5]), w4(x4[:1]), w8(x8[:5]), w8(x8[:1]), w4(x4), w8(x8)]
        finally:
            native.use_kernel_path(here)

    best = outputs()
    with build(monkeypatch, other):
        if other == "portable":
            assert native.panel_min_rows("int4") > len(x4)
            assert native.kernel_path() == "portable"
        theirs = outputs()
    for a, b in zip(best[:4], theirs[:4]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(best[4:], theirs[4:]):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()


@pytest.mark.parametrize("other", _builds()[1:] or [pytest.param("portable", marks=pytest.mark.skip)])
def test_every_build_attends_alike_from_a_float16_pool(monkeypatch, other):
    """The same on the other builds (the portable C, what an ARM machine runs, and AVX2 at head sizes its vectors do
    not take): their dot products once summed in whatever order the compiler chose for each element type, and a
    float16 pool gave other bits than a float32 one holding the same values."""
    with build(monkeypatch, other):
        for d in (64, 40, 12):
            _float16_pool_attends_as_float32(d)


def test_without_a_library_the_model_runs_torch_operations_and_says_so(monkeypatch, caplog):
    from engine.native import library

    library.cache_clear()
    try:
        with monkeypatch.context() as m:
            m.setenv("TANDEM_NATIVE", "0")
            assert library() is None and native.kernel_path() == "torch" and native.variant() == "none"
            library.cache_clear()
            m.setenv("TANDEM_NATIVE", "auto")
            m.setattr(dispatch, "variant_file", lambda variant: None)  # installed without a compiler
            with caplog.at_level("WARNING", logger="tandem.native"):
                assert library() is None
            assert "no build of engine/native/csrc is installed" in caplog.text
            assert "not the native path's numbers" in caplog.text
            library.cache_clear()
            m.undo()
            m.setattr(dispatch, "source_hash", lambda: "0123456789abcdef")  # the C edited since the build
            caplog.clear()
            with caplog.at_level("WARNING", logger="tandem.native"):
                assert library() is None
            assert "was built from other C" in caplog.text and "build_ext --inplace" in caplog.text
            library.cache_clear()
            m.undo()
            m.setenv("TANDEM_NATIVE", "sse9")
            with pytest.raises(ValueError, match="TANDEM_NATIVE='sse9': expected auto, off or one of avx512"):
                library()
    finally:
        library.cache_clear()
    assert native.available()


def test_the_model_decodes_the_same_with_native_and_torch_operations():
    """The real model, float32 weights: the same greedy tokens and logits within float32 rounding, prompt
    and decode steps alike, whichever operations run the layers."""
    from engine.engine import EngineConfig, LLMEngine
    from engine.loader import load_model
    from engine.model_files import DEFAULT_MODEL
    from engine.params import SamplingParams

    loaded = load_model(DEFAULT_MODEL, "float32", "none")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True)
    prompts = [chat_ids(loaded, q) for q in ("What is the capital of France?", "Write a haiku about rain.")]
    outputs = []
    for use_native in (True, False):
        engine = LLMEngine(loaded, EngineConfig(num_blocks=64, enable_prefix_cache=False))
        assert engine.model.native  # built here, so the switch below is what differs
        engine.model.native = use_native
        seqs = engine.generate(prompts, params)
        outputs.append([(s.output_ids, [lp.logprob for lp in s.logprobs]) for s in seqs])
        engine.blocks.check_idle()
    for (ids_a, lp_a), (ids_b, lp_b) in zip(*outputs):
        assert ids_a == ids_b
        assert max(abs(a - b) for a, b in zip(lp_a, lp_b)) < 1e-3


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_one_call_for_the_layers_computes_what_the_operations_do(smollm, kv_dtype):
    """The default model's layers are all int4/Q8_0: a decode step runs its layers as one `tq_decoder_layers`
    call; its tokens and logprobs are bit for bit those of the same step run one operation at a time, with
    either KV pool."""
    from engine.engine import EngineConfig, LLMEngine
    from engine.params import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
    prompts = [chat_ids(smollm, q) for q in ("What is the capital of France?", "Write a haiku about rain.")]
    outputs = []
    for fused in (True, False):
        engine = LLMEngine(smollm, EngineConfig(num_blocks=64, enable_prefix_cache=False, kv_dtype=kv_dtype))
        assert engine.pool.tensor.dtype == getattr(torch, kv_dtype)
        assert engine.model.fused_layers() is not None
        if not fused:
            engine.model.fused_layers = lambda: None
        seqs = engine.generate(prompts, params)
        outputs.append([(s.output_ids, [lp.logprob for lp in s.logprobs]) for s in seqs])
    assert outputs[0] == outputs[1]


def test_a_run_of_decode_steps_takes_its_layer_step_again(smollm, monkeypatch):
    """A step's `LayerStep` (its rows' buffers, their addresses checked) is made once for a run of decode steps of
    one batch size and taken again with each step's residual stream; other rows make their own; and the tokens and
    logprobs are those of steps that each make a new one."""
    from engine.engine import EngineConfig, LLMEngine
    from engine.params import SamplingParams

    made = []
    real = native.LayerStep
    monkeypatch.setattr(native, "LayerStep", lambda *a: made.append(real(*a)) or made[-1])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
    prompt = chat_ids(smollm, "Write a haiku about rain.")
    outputs = []
    for again in (True, False):
        if not again:
            monkeypatch.setattr(real, "again", lambda self, h, rows, scratch: False)
        made.clear()
        engine = LLMEngine(smollm, EngineConfig(num_blocks=64, enable_prefix_cache=False, speculative="off"))
        seq = engine.generate([prompt], params)[0]
        outputs.append((seq.output_ids, [lp.logprob for lp in seq.logprobs]))
        assert len(made) == (2 if again else 12)  # the prompt's step, then the decode steps'
    assert outputs[0] == outputs[1]
    step = engine.model._layer_step
    positions = step.rows[0].clone()
    monkeypatch.undo()
    assert not step.again(step.h, (positions, *step.rows[1:]), engine.model.layer_scratch)  # other rows
    assert not step.again(torch.zeros(2, step.h.shape[1]), step.rows, engine.model.layer_scratch)  # more rows
    assert step.again(step.h.clone(), step.rows, engine.model.layer_scratch)


def test_torchs_profiler_names_each_native_call_and_profiling_changes_no_token(smollm, monkeypatch):
    """Under `torch.profiler` a prompt chunk and the decode steps after it show their C calls as `tandem::*`
    ranges (a step's layers as one `tandem::decoder_layers`); the tokens and logprobs are those of the run unwatched."""
    from engine.engine import EngineConfig, LLMEngine
    from engine.params import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    prompt = chat_ids(smollm, "What is the capital of France?")
    runs = []
    for watched in (False, True):
        engine = LLMEngine(smollm, EngineConfig(num_blocks=32, enable_prefix_cache=False))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if watched \
                else contextlib.nullcontext() as prof:
            (seq,) = engine.generate([prompt], params)
        runs.append((seq.output_ids, [lp.logprob for lp in seq.logprobs]))
    assert runs[0] == runs[1]
    seen = {e.key: e.count for e in prof.key_averages() if e.key.startswith("tandem::")}
    assert seen.get("tandem::decoder_layers", 0) >= 3, seen  # 3 decode steps, every layer in one call each
    assert seen.get("tandem::argmax", 0) >= 3, seen
    recorded: list[str] = []  # what a native call opens with no profiler running: nothing
    monkeypatch.setattr(torch.profiler, "record_function", lambda name, *a: recorded.append(name))
    native.argmax(torch.zeros(1, 4))
    assert recorded == []


def test_a_short_chunks_token_computes_exactly_as_it_decodes(smollm):
    """With the default weights: resuming a short stream (its prompt and first tokens prefilled as one chunk
    of fewer than `native.panel_min_rows` tokens) gives the next tokens' logprobs bit for bit, because that
    chunk's rows run the decode rows' kernels and attention. (A longer chunk's linear layers run on float32
    panels: the same tokens, logprobs equal to float32 rounding; test_resume checks those streams.)"""
    from engine.engine import EngineConfig, LLMEngine
    from engine.linear_paths import KERNELS
    from engine.params import SamplingParams

    prompt = smollm.tokenizer.encode("Rivers of Europe: the")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)
    whole = LLMEngine(smollm, EngineConfig(num_blocks=64, enable_prefix_cache=False)).generate([prompt], params)[0]
    k = 4
    assert len(prompt) + k < min(native.panel_min_rows("int4"), KERNELS.kernel_max_chunk)
    engine = LLMEngine(smollm, EngineConfig(num_blocks=64, enable_prefix_cache=False))
    seq = engine.add_request("resumed", prompt, params, resume_ids=whole.output_ids[:k])
    while not seq.finished:
        engine.step()
    assert seq.output_ids == whole.output_ids
    after = len(whole.output_ids) - k  # the tokens computed after the resume
    assert [lp.logprob for lp in seq.logprobs[-after:]] == [lp.logprob for lp in whole.logprobs[k:]]


def test_the_kernel_path_is_the_best_here_and_tandem_kernels_chooses_another():
    """Start-up picks the fastest path the CPU has (int8 activations and bfloat16 attention, or bfloat16 panels,
    only where bfloat16 dot products outrun float32 FMAs; int8 first where the build has VNNI, and first of all
    where it has VNNI without bfloat16), never the
    invariant one; TANDEM_KERNELS forces one it has and refuses, naming what there
    is, one it lacks."""
    import subprocess
    import sys

    from engine.native import peaks
    from runtime.settings import KERNEL_CHOICES

    paths = kernel_paths()
    assert native.kernel_path() == paths[0] != native.INVARIANT and set(paths) <= set(native.KERNEL_PATHS)
    assert KERNEL_CHOICES == ("auto", *native.KERNEL_PATHS)  # --kernels names them without importing torch
    assert ("avx512_vnni" in paths) == bool(native.library().tq_has_i8())  # with bfloat16 or without
    if "avx512_vnni" in paths and "avx512_bf16" not in paths:
        assert paths[0] == "avx512_vnni"
    if "avx512_bf16" in paths:
        p = peaks.measure(1, iters=200_000)
        ratio = p.bf16_flops / p.fp32_flops  # 2x on AMD Zen 4, 0.5x on a Xeon: a clear side, on a quiet machine
        fast = "avx512_vnni" if "avx512_vnni" in paths else "avx512_bf16"
        if ratio > 1.6 * native.BF16_MARGIN or ratio < 0.7:
            assert paths[0] == (fast if ratio > 1 else "avx2"), p.describe()
    probe = [sys.executable, "-c", "from engine import native; print(native.kernel_path())"]
    for path in paths:
        env = {**os.environ, "TANDEM_KERNELS": path}
        out = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == path, out.stderr
    env = {**os.environ, "TANDEM_KERNELS": "avx9000"}  # refused before the model loads, in one line
    out = subprocess.run([sys.executable, "-m", "tandem.cli", "generate", "hi", "--max-tokens", "1"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: TANDEM_KERNELS='avx9000'"), out.stderr
    assert all(p in out.stderr for p in paths) and "Traceback" not in out.stderr
    with pytest.raises(ValueError, match="not available here"):
        native.use_kernel_path("avx9000")


def test_the_peaks_probe_measures_what_the_cpu_has():
    """Positive float32 and read rates; a bfloat16 rate exactly where the bfloat16 path exists."""
    from engine.native import peaks

    p = peaks.measure(1, iters=200_000)
    assert p.threads == 1 and p.fp32_flops > 1e8 and p.read_bytes > 1e8
    assert (p.bf16_flops > 0) == ("avx512_bf16" in kernel_paths())
    if p.bf16_flops:  # twice the multiply-adds per instruction, but not always twice the rate (one port on
        assert p.bf16_flops > 0.25 * p.fp32_flops  # some Xeons: 0.5x float32's FMA there)
    assert "float32 FMA" in p.describe() and "read" in p.describe()
    ones = torch.ones(64 * 1024)  # the read probe sums what it reads (exactly, in float32, for 2**16 ones)
    for threads in (1, 2):
        assert native.library().tq_probe_read(ones.data_ptr(), ones.numel(), threads) == ones.numel()


BF16 = pytest.mark.skipif("avx512_bf16" not in kernel_paths(), reason="this CPU or build has no AVX-512 BF16")
VNNI = pytest.mark.skipif("avx512_vnni" not in kernel_paths(), reason="this CPU or build has no AVX-512 VNNI")


def _int8_reference(kind: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    digits: int = 1) -> torch.Tensor:
    """x @ W.T as the C's int8 path defines it, in float64: each group of 32 activations rounded to p = round(x /
    s) (s = max |x| / top, ties to even; top 127 for one int8 digit, 16383 for two), sum over groups of s (d I + m P),
    I = p . q, P = sum p."""
    top = 127.0 if digits == 1 else 16383.0
    m, k = x.shape
    groups = x.view(m, k // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))  # not top / amax:
    p = torch.round(groups * inv).double()  # that is reciprocal(amax) * top, another rounding
    s = (amax / top).squeeze(-1).double()
    n = codes.shape[0]
    if kind == "q8_0":
        q = codes.view(n, k // 32, 32).double()
        d = scales.view(torch.float16).view(n, k // 32).double()
        offset = torch.zeros_like(d)
    else:  # int4: a byte's low nibble in group 2j, its high nibble in group 2j + 1
        pairs = codes.view(n, k // 64, 32)
        q = torch.stack([pairs & 15, pairs >> 4], 2).view(n, k // 32, 32).double()
        d, offset = scales.view(torch.float16).view(n, 2, k // 32).double().unbind(1)
    dots = torch.einsum("mgk,ngk->mng", p, q)
    return (s[:, None] * (d[None] * dots + offset[None] * p.sum(-1)[:, None])).sum(-1)


@VNNI
@pytest.mark.parametrize("kind, n, k", [("int4", 96, 576), ("int4", 64, 1536), ("q8_0", 35, 96), ("q8_0", 50, 1536)])
def test_int8_matmul_is_exact_integer_dot_products_of_the_rounded_rows(kind, n, k):
    """native.i8_matmul (kernel path avx512_vnni) on the packed weights computes what `_int8_reference` says, with
    one int8 digit (long chunks) and two (decode rows, short chunks): every group's integer dot product exact, then
    scaled in float32; rows in every tail height of both tiles, a partial panel (35 or 50 weight rows), a group of
    zeros and exact rounding ties. A row's bits are the same alone and in any batch. Two digits are float32's
    product to ~5e-5 (the int16 kernels' rounding; a group holding an outlier, as here, a few times that), one digit
    ten times further."""
    from engine import quant

    torch.manual_seed(n + k)
    if kind == "int4":
        w = quant.Int4Weight.quantize(torch.randn(n, k) * 0.05)
        codes, scales = w.qs, w.dm
    else:
        w = quant.Q8Weight(torch.randint(-127, 128, (n, k), dtype=torch.int8),
                           (torch.rand(n, k // 32) * 1e-3).half().view(torch.int16))
        codes, scales = w.q, w.scales
    panels = native.i8_pack(kind, codes, scales)
    assert panels.data.numel() == (n + 31) // 32 * 32 * (k // 32) * (20 if kind == "int4" else 34)  # the rows' bytes
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 40, 150, 400):  # 150 and 400: more than one block of rows (L2)
        x = torch.randn(rows, k)
        x[0, :32] = 0  # a group of zeros: scale 0, no NaN
        x[-1, 32:36] = torch.tensor([127.0, 2.5, 3.5, -2.5])  # ties: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2 (one digit)
        float32 = x @ w.dequantize().T
        error = {}
        for digits in (1, 2):
            got, want = native.i8_matmul(x, panels, digits), _int8_reference(kind, x, codes, scales, digits)
            assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), (kind, n, k, rows, digits)
            assert torch.equal(native.i8_matmul(x[-1:], panels, digits)[0], got[-1])
            into = torch.full((rows + 2, n), float("nan"))  # rows of a bigger output, as a mixed step's
            assert native.i8_matmul(x, panels, digits, into[1:-1]).data_ptr() == into[1].data_ptr()
            assert torch.equal(into[1:-1], got) and into[0].isnan().all() and into[-1].isnan().all()
            error[digits] = ((got - float32).abs().max() / float32.abs().max()).item()
        assert error[2] < 5e-4 and error[1] > 10 * error[2], error
        with pytest.raises(ValueError, match="out must be"):
            native.i8_matmul(x, panels, 1, torch.empty(rows, n + 1))


CHUNK_ATTENTION = pytest.mark.skipif(not native.has_chunk_attention(), reason="this build has no AVX-512")


@CHUNK_ATTENTION
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("length, context, heads, kv_heads, d, window", [
    (256, 256, 9, 3, 64, 0),  # a whole prompt in one chunk (SmolLM2's heads)
    (199, 199, 9, 3, 64, 0),  # rows not a multiple of the 6-row tile, keys not of the 64-key block
    (131, 500, 9, 3, 64, 0),  # a later chunk: 369 tokens cached
    (300, 700, 4, 1, 256, 128),  # Gemma 3's heads and a sliding window reaching back into the cache
    (257, 257, 9, 3, 64, 100),  # a window inside the chunk: early blocks hidden from late rows
])
def test_chunk_attention_of_a_long_chunk_is_float32_sdpa(length, context, heads, kv_heads, d, window, bf16):
    """A long prompt chunk's attention in the C (`native.chunk_attention`) is the float32 SDPA of the same rows over
    the same pool blocks (scattered, as the pool hands them out): to float32 rounding in float32, to bfloat16
    rounding in bfloat16 (where the build has AVX-512 BF16); it writes its rows only, and each row's result is the
    same whatever chunk it is computed in."""
    if bf16 and "avx512_bf16" not in kernel_paths():
        pytest.skip("this CPU or build has no AVX-512 BF16")
    g = torch.Generator().manual_seed(length)
    nblocks = (context + BLOCK - 1) // BLOCK
    kc, vc = torch.randn(nblocks + 9, BLOCK, kv_heads, d, generator=g), torch.randn(nblocks + 9, BLOCK, kv_heads, d, generator=g)
    blocks = torch.randperm(nblocks + 9, generator=g)[:nblocks]
    first = 2  # the chunk's rows in the flat batch: other rows before and after it
    qkv = torch.randn(first + length + 3, (heads + 2 * kv_heads) * d, generator=g)
    out = torch.zeros(qkv.shape[0], heads * d)
    native.chunk_attention(qkv, first, length, context, blocks, kc, vc, heads, 0.125, window, out, bf16)
    from_half = torch.zeros_like(out)  # a float16 pool: the same bits as float32 holding its values
    native.chunk_attention(qkv, first, length, context, blocks, kc.half(), vc.half(), heads, 0.125, window, from_half,
                           bf16)
    exact = torch.zeros_like(out)
    native.chunk_attention(qkv, first, length, context, blocks, kc.half().float(), vc.half().float(), heads, 0.125,
                           window, exact, bf16)
    assert torch.equal(from_half, exact)
    tail = torch.zeros_like(out)  # the chunk's last 7 rows alone, as the next chunk of the same prompt
    native.chunk_attention(qkv, first + length - 7, 7, context, blocks, kc, vc, heads, 0.125, window, tail, bf16)
    assert torch.equal(tail[first + length - 7:first + length], out[first + length - 7:first + length])
    q = qkv[first:first + length, :heads * d].view(length, heads, d).transpose(0, 1).unsqueeze(0)
    ks = kc[blocks].flatten(0, 1)[:context].transpose(0, 1).unsqueeze(0)
    vs = vc[blocks].flatten(0, 1)[:context].transpose(0, 1).unsqueeze(0)
    pos = torch.arange(context - length, context).unsqueeze(1)
    key = torch.arange(context).unsqueeze(0)
    mask = (key <= pos) & ((key > pos - window) if window else True)
    want = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, scale=0.125, enable_gqa=True)
    want = want.squeeze(0).transpose(0, 1).reshape(length, heads * d)
    got = out[first:first + length]
    err = (got - want).abs().max().item()
    if bf16:
        assert 1e-6 < err < 0.02 * want.abs().max().item()  # bfloat16 operands: close, and not float32's bits
    else:
        assert err < 2e-5 * want.abs().max().item()
    assert not out[:first].any() and not out[first + length:].any()


@CHUNK_ATTENTION
def test_chunk_attention_refuses_what_it_cannot_compute():
    """A head size the tiles do not take, and bfloat16 on a build without AVX-512 BF16, are refused with an error,
    not computed wrong."""
    blocks = torch.arange(4)
    kc = vc = torch.zeros(4, BLOCK, 1, 48)
    qkv, out = torch.zeros(40, 3 * 48), torch.zeros(40, 48)
    with pytest.raises(ValueError, match="head size 48"):
        native.chunk_attention(qkv, 0, 40, 40, blocks, kc, vc, 1, 0.125, 0, out, False)
    if "avx512_bf16" not in kernel_paths():
        kc = vc = torch.zeros(4, BLOCK, 1, 64)
        with pytest.raises(RuntimeError, match="no AVX-512 BF16"):
            native.chunk_attention(torch.zeros(40, 3 * 64), 0, 40, 40, blocks, kc, vc, 1, 0.125, 0,
                                   torch.zeros(40, 64), True)


@CHUNK_ATTENTION
def test_a_long_prompt_attends_in_the_c_in_bf16_only_where_its_matmuls_do(smollm, monkeypatch):
    """On an AVX-512 build a long prompt chunk attends in the C: in bfloat16 for a quantized model on the kernel
    paths whose long chunks multiply in bfloat16 (`native.bf16_attention_paths`), in float32 on the others and for
    float weights (`none`, the quality reference). The first token's logits agree with torch's float32 SDPA's: to
    float32 rounding for float weights, to bfloat16 and int8 rounding for the quantized ones."""
    from engine import attention
    from engine.engine import EngineConfig, LLMEngine
    from engine.loader import load_model
    from engine.model_files import DEFAULT_MODEL

    calls = []
    real = native.chunk_attention
    monkeypatch.setattr(native, "chunk_attention", lambda *a: calls.append((a[2], a[-1])) or real(*a))
    prompt = torch.randint(100, 30000, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    here = native.kernel_path()
    paths = [p for p in native.kernel_paths() if p in (*native.PANEL_PRECISION, "avx2")]
    try:
        for loaded in (smollm, load_model(DEFAULT_MODEL, "float32", "none")):
            engine = LLMEngine(loaded, EngineConfig(num_blocks=64, max_step_tokens=512, enable_prefix_cache=False))
            for path in paths:
                native.use_kernel_path(path)
                calls.clear()
                got = engine.prompt_logits(prompt, [])[-1]
                rounded = path in native.bf16_attention_paths() and loaded.quantization == "auto:int4+q8_0"
                assert calls == [(300, rounded)] * 30
                with monkeypatch.context() as m:
                    m.setattr(attention.native, "has_chunk_attention", lambda: False)
                    calls.clear()
                    sdpa = engine.prompt_logits(prompt, [])[-1]
                    assert calls == []
                err = (got - sdpa).abs().max() / sdpa.abs().max()
                # int8 activations and bfloat16 round a float32 difference up to a code step now and then
                assert err < (1e-4 if loaded.quantization == "none" else 0.05), (loaded.quantization, path, err)
    finally:
        native.use_kernel_path(here)
