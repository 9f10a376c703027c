"""Which kernel paths this machine and build have (engine.native's kernels are built when the package is installed)."""

from __future__ import annotations

import pytest


def _native_available() -> bool:
    from engine import native

    return native.available()


#: tests of what engine.native's kernels compute (or of workers run with `--kernels invariant`): without a build
#: (TANDEM_NATIVE=0, no compiler at install time) torch's operations run, which are not the same computation
NEEDS_NATIVE = pytest.mark.skipif(not _native_available(),
                                  reason="needs engine.native's kernels; torch's operations compute otherwise")


def kernel_paths() -> list[str]:
    """The kernel paths this machine and build have (engine.native.kernel_paths, fastest first); ["torch"]
    without the library."""
    from engine import native

    return native.kernel_paths() or ["torch"]


PANEL_TOLERANCE = {"avx2": 1e-4, "portable": 1e-4, "avx512_bf16": 1e-2, "avx512_vnni": 2e-2, "neon_dotprod": 2e-2,
                   "invariant": 1e-4}  # of a long chunk's largest output
#: kernel paths whose long chunks are rounded (bfloat16, int8 activations) -> the rows of their register tiles
ROUNDED_TILE_ROWS = {"avx512_bf16": 12, "avx512_vnni": 6, "neon_dotprod": 3}
