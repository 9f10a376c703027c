"""engine/native's int4 / Q8_0 kernels on aarch64 (NEON), cross-compiled and run under qemu-user.

On an ARM machine the decode rows take the int16 kernels (csrc/int16_kernels.c), which have a NEON path beside the
AVX2 one, or, where the CPU has the int8 dot product (ARMv8.2 dotprod: the `neon_dotprod` build), every row takes
the packed int8 panels (csrc/i8_panels.c) as AVX-512 VNNI does. No ARM machine runs the suite, so this compiles the
library's C with `aarch64-linux-gnu-gcc` three ways (as the `portable` build compiles on aarch64, NEON only; as
`neon_dotprod`; and without SIMD), links `tests/aarch64/native_check.c`, and runs them under `qemu-aarch64` on the
same inputs: the NEON int16 kernels must agree with the scalar C and with this machine's build, and the dotprod
panels give the same bits as this machine's VNNI panels. `.ci/run` installs the cross compiler and qemu (Debian's
`gcc-aarch64-linux-gnu qemu-user`); where they are missing the tests skip.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import native
from engine.native.build import CSRC, VARIANTS, sources
from tests.harness.native import NEEDS_NATIVE

CC, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", Path("/usr/aarch64-linux-gnu")
DRIVER = Path(__file__).with_name("aarch64") / "native_check.c"

pytestmark = pytest.mark.skipif(not (shutil.which(CC) and shutil.which(QEMU) and SYSROOT.is_dir()),
                                reason=f"needs {CC} and {QEMU} (Debian: gcc-aarch64-linux-gnu qemu-user)")

#: (kind, n, k, m): int4 batch 1 with k < 1024 takes tiles of two weight rows; 5 rows a tile of 4 and one of 1;
#: Q8_0 of 3 groups ends with a group alone
SHAPES = [("int4", 96, 576, 1), ("int4", 64, 1536, 5), ("int4", 33, 128, 3),
          ("q8_0", 64, 576, 1), ("q8_0", 40, 96, 3), ("q8_0", 33, 1536, 4)]
KIND = {"int4": 4, "q8_0": 8}


def _build(out: Path, flags: list[str]) -> Path:
    cmd = [CC, "-O3", "-fopenmp", "-fno-wrapv", "-Wall", "-Werror", '-DTQ_SOURCE_HASH="cross"', *flags,
           *map(str, sources(CSRC)), str(DRIVER), "-o", str(out), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    """The aarch64 variants' flags as setup.py compiles them (`portable`: NEON; `neon_dotprod`), and no SIMD."""
    tmp = tmp_path_factory.mktemp("aarch64")
    flags = {v.name: list(v.flags) for v in VARIANTS if v.builds_here("aarch64")}
    return {"neon": _build(tmp / "check_neon", flags["portable"]),
            "dotprod": _build(tmp / "check_dotprod", flags["neon_dotprod"]),
            "scalar": _build(tmp / "check_scalar", ["-march=armv8-a+nosimd"])}


def _qemu(exe: Path, *args: str | Path) -> None:
    """Run the aarch64 `exe` with `args` under qemu-user (its libraries from the cross sysroot)."""
    subprocess.run([QEMU, "-L", str(SYSROOT), str(exe), *map(str, args)], check=True, capture_output=True,
                   timeout=120)


def _weights(kind: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes and float16 scales in the layouts `native.q4_matmul` / `q8_matmul` take."""
    groups = k // 32
    if kind == "int4":
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        d = torch.rand(n, groups, generator=gen) * 0.04 + 0.01
        scales = torch.stack([d, -8 * d * (0.5 + torch.rand(n, groups, generator=gen))], dim=1)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        scales = torch.rand(n, groups, generator=gen) * 0.01 + 0.001
    return codes, scales.half().view(torch.int16).contiguous()


def _run(exe: Path, tmp: Path, kind: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
         threads: int = 2, digits: int = 0) -> torch.Tensor:
    """`exe`'s matmul under qemu: the int16 kernels, or with `digits` the int8 panels."""
    m, k = x.shape
    n = codes.shape[0]
    (tmp / "in").write_bytes(np.array([KIND[kind], n, k, m, threads, digits], dtype=np.int64).tobytes()
                             + x.numpy().tobytes() + codes.numpy().tobytes() + scales.numpy().tobytes())
    _qemu(exe, tmp / "in", tmp / "out")
    return torch.from_numpy(np.fromfile(tmp / "out", dtype=np.float32).reshape(m, n).copy())


def _dequantized(kind: str, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weights in float64: d q (+ m for int4), with int4's paired-group nibbles unpacked."""
    s = scales.view(torch.float16).double()
    if kind == "q8_0":
        return (codes.double().view(codes.shape[0], -1, 32) * s.unsqueeze(-1)).reshape(codes.shape[0], -1)
    n, half = codes.shape
    pairs = codes.view(n, half // 32, 32).int()
    q = torch.stack([pairs & 15, pairs >> 4], dim=2).reshape(n, -1, 32).double()  # group 2p, then 2p + 1
    return (q * s[:, 0].unsqueeze(-1) + s[:, 1].unsqueeze(-1)).reshape(n, -1)


@pytest.mark.parametrize("kind,n,k,m", SHAPES)
def test_neon_kernels_match_the_scalar_c_and_the_dequantized_weights(builds, tmp_path, kind, n, k, m):
    gen = torch.Generator().manual_seed(n * k + m)
    codes, scales = _weights(kind, n, k, gen)
    x = torch.randn(m, k, generator=gen)
    neon = _run(builds["neon"], tmp_path, kind, x, codes, scales)
    scalar = _run(builds["scalar"], tmp_path, kind, x, codes, scales)
    top = float(scalar.abs().max())
    # the same int16 activations and exact int32 group sums; only the order of the float sums differs
    assert torch.allclose(neon, scalar, rtol=0, atol=2e-6 * top), float((neon - scalar).abs().max()) / top
    exact = (x.double() @ _dequantized(kind, codes, scales).T).float()
    assert torch.allclose(neon, exact, rtol=0, atol=2e-4 * float(exact.abs().max()))  # int16 activations: 15 bits


@NEEDS_NATIVE
@pytest.mark.parametrize("kind,n,k,m", [s for s in SHAPES if s[3] < 16])
def test_neon_kernels_match_this_machines_build(builds, tmp_path, kind, n, k, m):
    """The aarch64 build and this machine's compute the same int16 kernel (below `panel_min_rows` on x86)."""
    gen = torch.Generator().manual_seed(7 * n + k + m)
    codes, scales = _weights(kind, n, k, gen)
    x = torch.randn(m, k, generator=gen)
    here = (native.q4_matmul if kind == "int4" else native.q8_matmul)(x, codes, scales)
    neon = _run(builds["neon"], tmp_path, kind, x, codes, scales, threads=1)
    top = float(here.abs().max())
    assert torch.allclose(neon, here, rtol=0, atol=2e-6 * top), float((neon - here).abs().max()) / top


def test_the_neon_build_takes_the_neon_path(builds):
    """The NEON build's kernels are NEON code (its dot products are SMLAL), the other's are not."""
    def disassembly(exe: Path) -> str:
        return subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(exe)], check=True, capture_output=True,
                              text=True).stdout
    if not shutil.which("aarch64-linux-gnu-objdump"):
        pytest.skip("needs aarch64-linux-gnu-objdump (binutils-aarch64-linux-gnu)")
    assert "smlal" in disassembly(builds["neon"])
    assert "smlal" not in disassembly(builds["scalar"])
    assert "sdot" in disassembly(builds["dotprod"]) and "sdot" not in disassembly(builds["neon"])


#: (kind, n, k, m): 1-7 rows meet tiles of 1, 2 (two digits) and 3 (one digit) rows; n = 40 a panel's spill
I8_SHAPES = [("int4", 96, 576, 1), ("int4", 40, 1536, 5), ("int4", 64, 128, 7),
             ("q8_0", 64, 576, 1), ("q8_0", 40, 96, 3), ("q8_0", 33, 1536, 6)]


def _has_i8() -> bool:
    return native.available() and bool(native.library().tq_has_i8())


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("kind,n,k,m", I8_SHAPES)
def test_dotprod_panels_match_the_dequantized_weights(builds, tmp_path, kind, n, k, m, digits):
    gen = torch.Generator().manual_seed(n + k * m + digits)
    codes, scales = _weights(kind, n, k, gen)
    x = torch.randn(m, k, generator=gen)
    got = _run(builds["dotprod"], tmp_path, kind, x, codes, scales, digits=digits)
    exact = (x.double() @ _dequantized(kind, codes, scales).T).float()
    # activations rounded per group of 32 to 8 bits (one digit) or 15 (two)
    assert torch.allclose(got, exact, rtol=0, atol=(2e-2 if digits == 1 else 2e-4) * float(exact.abs().max()))


@pytest.mark.skipif(not _has_i8(), reason="this machine's build has no int8 dot product (AVX-512 VNNI) to compare with")
@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("kind,n,k,m", I8_SHAPES)
def test_dotprod_panels_give_this_machines_vnni_bits(builds, tmp_path, kind, n, k, m, digits):
    """The same exact integer sums, then the same float operations column by column: the same bits."""
    gen = torch.Generator().manual_seed(3 * n + k + m + digits)
    codes, scales = _weights(kind, n, k, gen)
    x = torch.randn(m, k, generator=gen)
    here = native.i8_matmul(x, native.i8_pack(kind, codes, scales), digits)
    arm = _run(builds["dotprod"], tmp_path, kind, x, codes, scales, digits=digits)
    assert torch.equal(arm, here), float((arm - here).abs().max())


def test_only_the_dotprod_build_has_the_int8_panels(builds, tmp_path):
    """ARMv8-A without the dot product (the portable build) says it has no int8 panels (exit 3); dotprod does."""
    gen = torch.Generator().manual_seed(1)
    codes, scales = _weights("q8_0", 32, 64, gen)
    x = torch.randn(1, 64, generator=gen)
    with pytest.raises(subprocess.CalledProcessError) as no_i8:
        _run(builds["neon"], tmp_path, "q8_0", x, codes, scales, digits=2)
    assert no_i8.value.returncode == 3
    assert _run(builds["dotprod"], tmp_path, "q8_0", x, codes, scales, digits=2).shape == (1, 32)


def _probes(exe: Path, tmp: Path) -> list[float]:
    _qemu(exe, "--probes", tmp / "probes")
    return np.fromfile(tmp / "probes", dtype=np.float64).tolist()


def test_the_peak_probes_count_neons_operations(builds, tmp_path):
    """`engine.native.peaks` times these for `bench.engine`'s rooflines: float32 FMAs 4 lanes wide (12 chains, 1,000
    rounds, 2 ops each), sdot's 16 multiply-adds where the build has it (none on the portable build), and the read
    probe's sum."""
    fma, dot, read = _probes(builds["dotprod"], tmp_path)
    assert (fma, dot, read) == (2 * 4 * 12 * 1000, 2 * 16 * 12 * 1000, 4096)
    assert _probes(builds["neon"], tmp_path)[1:] == [0, 4096]


def _attend(exe: Path, tmp: Path, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
            lens: torch.Tensor, heads: int, scale: float, threads: int = 2) -> torch.Tensor:
    """`exe`'s tq_paged_attention under qemu (row r reads table r)."""
    blocks, bs, kv_heads, d = keys.shape
    rows = q.shape[0]
    header = [rows, heads, kv_heads, d, bs, blocks, tables.shape[1], int(keys.dtype == torch.float16), threads]
    (tmp / "att").write_bytes(np.array(header, dtype=np.int64).tobytes() + np.float32(scale).tobytes()
                              + q.numpy().tobytes() + keys.numpy().tobytes() + values.numpy().tobytes()
                              + tables.numpy().tobytes() + lens.numpy().tobytes())
    _qemu(exe, "--attention", tmp / "att", tmp / "att_out")
    return torch.from_numpy(np.fromfile(tmp / "att_out", dtype=np.float32).reshape(rows, heads * d).copy())


@pytest.mark.parametrize("d", [64, 12])
def test_arm_attention_reads_a_float16_pool_as_float32_holding_its_values(builds, tmp_path, d):
    """On aarch64 decode attention runs the C's scalar path (vectorized by the compiler): a float16 pool gives the
    bits of a float32 pool holding the same values (its dot products sum in a fixed order), and this machine's
    build's results to float32 rounding."""
    g = torch.Generator().manual_seed(d)
    heads, kv_heads, bs, blocks = 9, 3, 16, 40
    keys = torch.randn(blocks, bs, kv_heads, d, generator=g).half()
    values = torch.randn(blocks, bs, kv_heads, d, generator=g).half()
    tables = torch.stack([torch.randperm(blocks, generator=g)[:12] for _ in range(4)])
    lens = torch.tensor([33, 190, 7, 128])
    q = torch.randn(4, heads * d, generator=g)
    half = _attend(builds["dotprod"], tmp_path, q, keys, values, tables, lens, heads, 0.3)
    single = _attend(builds["dotprod"], tmp_path, q, keys.float(), values.float(), tables, lens, heads, 0.3)
    assert torch.equal(half, single)
    assert torch.equal(_attend(builds["neon"], tmp_path, q, keys, values, tables, lens, heads, 0.3, threads=1), half)
    if native.available():
        here = native.paged_attention(q, keys, values, tables, torch.arange(4), lens, heads, 0.3)
        assert torch.allclose(half, here, rtol=0, atol=1e-5)
