"""Shared fixtures and hooks (helpers live in tests/harness/): the real default model, loaded once per test
session; each kernel path in turn; the fake-worker gateway tests' bus, tokenizer and event loop."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

from tests.harness.native import kernel_paths

if TYPE_CHECKING:
    from bus.server import EmbeddedNats
    from gateway.textmodel import TextModel
    from tests.harness.fakes import LoopThread

os.environ.setdefault("UCX_NET_DEVICES", "lo")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture(scope="module")
def text_model() -> TextModel:
    """The default model's tokenizer and chat template (what a gateway loads)."""
    from engine.model_files import DEFAULT_MODEL
    from gateway.textmodel import load_text_model

    return load_text_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def nats_srv() -> Iterator[EmbeddedNats]:
    """A nats-server of the module's own."""
    from bus.server import EmbeddedNats

    with EmbeddedNats() as srv:
        yield srv


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    """The asyncio loop the module's fake workers run on."""
    from tests.harness.fakes import LoopThread

    lt = LoopThread()
    yield lt
    lt.stop()
