"""engine/native's int4 / Q8_0 kernels on aarch64 (NEON), cross-compiled and run under qemu-user.

The decode rows of an ARM machine take the int16 kernels (csrc/int16_kernels.c), which have a NEON path beside
the AVX2 one. No ARM machine runs the suite, so this compiles the library's C with `aarch64-linux-gnu-gcc`, once as
the `portable` build compiles on aarch64 (NEON: every ARMv8-A CPU has it) and once without SIMD, links
`tests/aarch64/matmul_check.c`, and runs both under `qemu-aarch64` on the same inputs: the NEON build must agree
with the scalar C, and with this machine's own build. `.ci/run` installs the cross compiler and qemu (Debian's
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
from engine.native.build import CSRC, sources
from tests.harness.native import NEEDS_NATIVE

CC, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", Path("/usr/aarch64-linux-gnu")
DRIVER = Path(__file__).with_name("aarch64") / "matmul_check.c"

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
    tmp = tmp_path_factory.mktemp("aarch64")
    return {"neon": _build(tmp / "check_neon", []),
            "scalar": _build(tmp / "check_scalar", ["-march=armv8-a+nosimd"])}


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
         threads: int = 2) -> torch.Tensor:
    m, k = x.shape
    n = codes.shape[0]
    (tmp / "in").write_bytes(np.array([KIND[kind], n, k, m, threads], dtype=np.int64).tobytes()
                             + x.numpy().tobytes() + codes.numpy().tobytes() + scales.numpy().tobytes())
    subprocess.run([QEMU, "-L", str(SYSROOT), str(exe), str(tmp / "in"), str(tmp / "out")], check=True,
                   capture_output=True, timeout=120)
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
