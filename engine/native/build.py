"""How the C in ``csrc/`` is compiled: one shared library per instruction-set variant, built when the package
is installed (``setup.py``), the best one the CPU runs chosen when a process starts (``engine.native``).

No imports from the project or torch: ``setup.py`` loads this file by path in the build environment.
"""

from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")  # the library's C: its files, one job each, and the header they share
COMMON_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-fno-wrapv")  # Python's CFLAGS add -fwrapv


@dataclass(frozen=True)
class Variant:
    """One build of the C: its compiler flags and the CPU flags (``/proc/cpuinfo`` names) it needs."""

    name: str
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    machines: tuple[str, ...] = ()  # platform.machine() values it compiles for; () = any

    @property
    def module(self) -> str:
        """Its extension module name inside ``engine.native``."""
        return f"_ops_{self.name}"

    def builds_here(self, machine: str | None = None) -> bool:
        return not self.machines or (machine or platform.machine()) in self.machines

    def runs_on(self, cpu_flags: set[str], machine: str | None = None) -> bool:
        return self.builds_here(machine) and set(self.cpu_flags) <= cpu_flags


_X86 = ("x86_64", "AMD64")
#: best first: a process loads the first one its CPU runs
VARIANTS = (
    # x86-64-v4 (AVX-512 F/BW/CD/DQ/VL) with the bfloat16 and VNNI dot products: Zen 4, Sapphire Rapids
    Variant("avx512", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=generic"),
            ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16",
             "avx512_vnni"), _X86),
    # x86-64-v4 with VNNI, without bfloat16 (Cascade Lake, Ice Lake): the int8 path, float32 everywhere else
    Variant("avx512_vnni", ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"),
            ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"), _X86),
    # x86-64-v3: AVX2, FMA, F16C (Haswell and later, Zen 1 and later)
    Variant("avx2", ("-march=x86-64-v3", "-mtune=generic"), ("avx2", "fma", "f16c", "bmi2"), _X86),
    # ARMv8.2-A with the int8 dot product (Graviton 2 on, Ampere Altra, Apple M1 on, Cortex-A76 on): the int8 path
    Variant("neon_dotprod", ("-march=armv8.2-a+dotprod",), ("asimd", "asimddp"), ("aarch64", "arm64")),
    # any CPU, as the compiler targets it by default: scalar C on x86; NEON for the int16 kernels on aarch64
    Variant("portable", (), ()),
)


def sources(csrc: Path = CSRC) -> list[Path]:
    """The C files one library is compiled from."""
    return sorted(csrc.glob("*.c"))


def headers(csrc: Path = CSRC) -> list[Path]:
    """The headers those files include."""
    return sorted(csrc.glob("*.h"))


def source_hash(csrc: Path = CSRC) -> str:
    """What a library says it was built from (``tq_source_hash``): every file of ``csrc`` (names and bytes), so
    a stale build is refused, not run."""
    digest = hashlib.sha256()
    for path in sorted([*sources(csrc), *headers(csrc)]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def compile_args(variant: Variant, csrc: Path = CSRC) -> list[str]:
    return [*COMMON_FLAGS, *variant.flags, f'-DTQ_SOURCE_HASH="{source_hash(csrc)}"']


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())
