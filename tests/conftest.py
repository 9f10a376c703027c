"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _native_available() -> bool:
    from engine import native

    return native.available()


#: tests whose workers run `--kernels invariant`: engine.native's kernels (no C compiler: they cannot start)
NEEDS_NATIVE = pytest.mark.skipif(not _native_available(), reason="--kernels invariant needs engine.native's kernels")


def kernel_paths() -> list[str]:
    """The kernel paths this machine and build have (engine.native.kernel_paths, fastest first); ["torch"]
    without the library."""
    from engine import native

    return native.kernel_paths() or ["torch"]


PANEL_TOLERANCE = {"avx2": 1e-4, "portable": 1e-4, "avx512_bf16": 1e-2, "invariant": 1e-4}  # of a long chunk's largest output


@pytest.fixture(params=kernel_paths())
def kernel_path(request):
    """Each kernel path in turn (the process's own restored after); "torch" where there is no library."""
    from engine import native

    if request.param == "torch":
        yield "torch"
        return
    here = native.kernel_path()
    native.use_kernel_path(request.param)
    try:
        yield request.param
    finally:
        native.use_kernel_path(here)


@pytest.fixture(scope="session")
def smollm():
    from engine.loader import load_model
    from engine.model_files import DEFAULT_MODEL

    return load_model(DEFAULT_MODEL, "float32")


@pytest.fixture
def make_engine(smollm):
    """Engines over the default model; every one must end with all its blocks free."""
    from engine.engine import EngineConfig, LLMEngine

    engines = []

    def make(**kw) -> LLMEngine:
        kw.setdefault("num_blocks", 128)
        e = LLMEngine(smollm, EngineConfig(**kw))
        engines.append(e)
        return e

    yield make
    for e in engines:
        assert not e.has_work()
        e.blocks.check_idle()


def chat_ids(loaded, message: str) -> list[int]:
    return loaded.tokenizer.encode(loaded.chat_template.render([{"role": "user", "content": message}]))
