"""Kernel path ``invariant`` (``--kernels invariant``): with the default weights, a request's tokens and logits
are a function of the request alone: batch 1 or 64, whole prefill or chunked, prefix-cache hit or miss,
resumed after migration, with or without speculation, on one thread or two. The cluster tests (local and
remote prefill, migrated streams, seeds through the API) run their workers on this path too."""

from __future__ import annotations

import random

import pytest
import torch

from engine import native
from engine.params import SamplingParams
from tests.harness.chat import chat_ids

pytestmark = pytest.mark.skipif(not native.available(), reason="the invariant path is engine.native's kernels")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True, logprobs=True)


@pytest.fixture
def invariant():
    here = native.kernel_path()
    native.use_kernel_path(native.INVARIANT)
    try:
        yield
    finally:
        native.use_kernel_path(here)


def _prompts(smollm, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = "river bridge city mountain story engine light winter harbour market garden".split()
    return [chat_ids(smollm, " ".join(rng.choice(words) for _ in range(rng.randint(3, 90)))) for _ in range(n)]


def _answer(seq) -> tuple[list[int], list[float], list]:
    return seq.output_ids, [lp.logprob for lp in seq.logprobs], [lp.top for lp in seq.logprobs]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_computes_the_same_alone_and_among_63_others(invariant, make_engine, smollm, params):
    prompts = _prompts(smollm, 64)
    alone = make_engine(num_blocks=1200, max_batch=64).generate([prompts[5]], params)[0]
    crowd = make_engine(num_blocks=1200, max_batch=64, max_step_tokens=2048).generate(prompts, params)
    assert _answer(crowd[5]) == _answer(alone)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chunked_prefill_cache_hits_speculation_and_threads_change_nothing(invariant, make_engine, smollm, params):
    prompt = chat_ids(smollm, "Copy this list twice: river, bridge, city, mountain, story, engine, light. " * 6)
    want = _answer(make_engine(enable_prefix_cache=False, speculative="off").generate([prompt], params)[0])
    assert _answer(make_engine(max_step_tokens=16, speculative="off").generate([prompt], params)[0]) == want
    cached = make_engine(speculative="off")
    cached.generate([prompt[:-7]], params)  # a shorter prompt first: the second one hits its blocks
    hit = cached.generate([prompt], params)[0]
    assert hit.cached_prompt_tokens and _answer(hit) == want
    assert _answer(make_engine(speculative="ngram").generate([prompt], params)[0]) == want
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert _answer(make_engine(speculative="off").generate([prompt], params)[0]) == want
    finally:
        torch.set_num_threads(threads)


def test_a_resumed_stream_continues_bit_for_bit(invariant, make_engine, smollm):
    """A stream moved to another worker is prefilled again there with its tokens so far, as one long chunk."""
    prompt = _prompts(smollm, 1, seed=3)[0]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True, logprobs=True)
    whole = make_engine(speculative="off").generate([prompt], params)[0]
    engine = make_engine(speculative="off")
    seq = engine.add_request("moved", prompt, params, resume_ids=whole.output_ids[:5])
    while not seq.finished:
        engine.step()
    assert seq.output_ids == whole.output_ids
    assert [lp.logprob for lp in seq.logprobs[-7:]] == [lp.logprob for lp in whole.logprobs[5:]]


def test_a_prompt_computed_one_token_a_step_beside_decoding_rows_reads_as_alone(invariant, make_engine, smollm):
    """Three streams decode while a prompt gets the step budget's last token each step: its one-token chunks
    are chunks, not decode rows (sampled, each would have ended the prompt there: a bug this file's property
    test found); its logits equal those of the prompt alone. And a budget of one token still finishes."""
    prompts = _prompts(smollm, 4, seed=5)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True) for _ in range(3)] + [GREEDY]
    engine = make_engine(max_step_tokens=4, speculative="off")
    seen = LogitsRecorder(engine)
    short = [engine.add_request(f"s{i}", p[:1], params[i]) for i, p in enumerate(prompts[:3])]
    engine.step()
    long = engine.add_request("long", prompts[3], params[3])
    while long.num_computed < 8:
        engine.step()
    assert all(s.num_computed > 3 for s in short)  # they decoded meanwhile: the prompt got 1 token a step
    while engine.has_work():
        engine.step()
    solo = make_engine(speculative="off")
    alone = LogitsRecorder(solo)
    want = solo.generate([prompts[3]], GREEDY)[0]
    assert _answer(long) == _answer(want)
    assert all(torch.equal(a, b) for a, b in zip(seen.rows[id(GREEDY)], alone.rows[id(GREEDY)], strict=True))
    tiny = make_engine(max_step_tokens=1, speculative="off").generate([prompts[0][:20]], GREEDY)[0]
    assert _answer(tiny) == _answer(make_engine(speculative="off").generate([prompts[0][:20]], GREEDY)[0])


def test_weights_the_kernels_do_not_multiply_are_refused_on_the_invariant_path(invariant):
    """float32 weights go through MKL, whose result depends on the row count: the path says so at start-up
    rather than promising what it cannot keep."""
    from engine.engine import EngineConfig, LLMEngine
    from engine.loader import load_model
    from engine.model_files import DEFAULT_MODEL

    with pytest.raises(ValueError, match="--kernels invariant cannot .*none weights"):
        LLMEngine(load_model(DEFAULT_MODEL, "float32", "none"), EngineConfig(num_blocks=16))


class LogitsRecorder:
    """Wraps an engine's sampler: every row's logits, by the request (its params object) they belong to."""

    def __init__(self, engine):
        self.sampler, self.rows = engine.runner.sampler, {}
        engine.runner.sampler = self

    def __call__(self, logits, params, *args):
        for row, p in zip(logits, params):
            self.rows.setdefault(id(p), []).append(row.clone())
        return self.sampler(logits, params, *args)


def test_random_batch_compositions_give_bit_identical_logits_per_row(invariant, make_engine, smollm):
    """Property: requests arriving at random steps, in random step budgets, with shared prefixes: each row's
    logits equal, bit for bit, those of its request computed alone."""
    rng = random.Random(1)
    base = _prompts(smollm, 40, seed=2)
    for trial in range(4):
        prompts = [rng.choice(base) for _ in range(rng.randint(2, 10))]
        prompts = [p[: rng.randint(8, len(p))] if rng.random() < 0.3 else p for p in prompts]
        params = [SamplingParams(max_tokens=rng.randint(1, 6), temperature=0.0, ignore_eos=True) for _ in prompts]
        engine = make_engine(num_blocks=600, max_step_tokens=rng.choice([16, 64, 200, 512]), speculative="off")
        seen = LogitsRecorder(engine)
        pending = list(enumerate(prompts))
        seqs = {}
        while pending or engine.has_work():
            while pending and (not engine.has_work() or rng.random() < 0.4):
                i, prompt = pending.pop(0)
                seqs[i] = engine.add_request(f"t{trial}-{i}", prompt, params[i])
            engine.step()
        for i, prompt in enumerate(prompts):
            solo = make_engine(num_blocks=600, enable_prefix_cache=False, speculative="off")
            alone = LogitsRecorder(solo)
            solo.generate([prompt], params[i])
            got, want = seen.rows[id(params[i])], alone.rows[id(params[i])]
            assert len(got) == len(want) == params[i].max_tokens
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"trial {trial}, request {i}"
            assert seqs[i].finished
