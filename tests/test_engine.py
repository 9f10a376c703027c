"""Engine invariants on the real default model: batching, paging, prefix cache, chunking, preemption."""

from __future__ import annotations

import pytest

from engine.params import SamplingParams
from tests.harness.chat import chat_ids
from tests.harness.kv_connector import RecordingConnector

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the moon.",
    "What is 12 times 12?",
]
# With quantized weights the kernels round activations to bfloat16, which moves logits by up to ~0.75 here
# when the same token is computed in another batch, chunk or attention shape; greedy outputs then agree
# up to a near-tie. A divergence where the reference's two likeliest tokens were further apart is a bug.
NEAR_TIE = 1.0


@pytest.fixture(scope="module", params=["none", "auto"])
def model(request, smollm):
    """The default model with float32 weights (exact invariants) and with its own quantization (default)."""
    from engine.loader import load_model
    from engine.model_files import DEFAULT_MODEL

    return smollm if request.param == "auto" else load_model(DEFAULT_MODEL, "float32", "none")


@pytest.fixture(scope="module")
def greedy_reference(model):
    """Greedy output of each question run alone, no prefix cache, with the margin of every choice."""
    from engine.engine import EngineConfig, LLMEngine

    engine = LLMEngine(model, EngineConfig(num_blocks=64, enable_prefix_cache=False))
    out = {}
    for q in QUESTIONS:
        params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True, logprobs=True,
                                top_logprobs=2)
        [seq] = engine.generate([chat_ids(model, q)], params)
        out[q] = (seq.output_ids, [lp.top[0][1] - lp.top[1][1] for lp in seq.logprobs])
    engine.blocks.check_idle()
    return out


@pytest.fixture
def make_model_engine(model):
    """Engines over `model`; every one must end with all its blocks free."""
    from engine.engine import EngineConfig, LLMEngine

    engines = []

    def make(**kw) -> LLMEngine:
        kw.setdefault("num_blocks", 128)
        engines.append(LLMEngine(model, EngineConfig(**kw)))
        return engines[-1]

    yield make
    for e in engines:
        assert not e.has_work()
        e.blocks.check_idle()


def assert_same_greedy(model, got: list[int], want: tuple[list[int], list[float]]) -> None:
    ids, margins = want
    if model.quantization == "none":
        assert got == ids
        return
    for i, (a, b) in enumerate(zip(got, ids)):
        if a != b:
            assert margins[i] < NEAR_TIE, f"token {i}: {a}, not {b}, where the reference's margin was {margins[i]:.2f}"
            return
    assert len(got) == len(ids)


@pytest.fixture(scope="module")
def reference(smollm):
    """Greedy output of each question alone with the default weights (for the tests of text and stops)."""
    from engine.engine import EngineConfig, LLMEngine

    engine = LLMEngine(smollm, EngineConfig(num_blocks=64, enable_prefix_cache=False))
    return {q: engine.generate([chat_ids(smollm, q)], GREEDY)[0].output_ids for q in QUESTIONS}


def test_capital_of_france(smollm, make_engine):
    [seq] = make_engine().generate([chat_ids(smollm, "What is the capital of France?")],
                                   SamplingParams(max_tokens=32, temperature=0.0))
    assert "Paris" in seq.text
    assert seq.finish_reason == "stop"


def test_batched_equals_one_by_one(model, make_model_engine, greedy_reference):
    engine = make_model_engine(enable_prefix_cache=False)
    seqs = engine.generate([chat_ids(model, q) for q in QUESTIONS], GREEDY)
    for s, q in zip(seqs, QUESTIONS):
        assert_same_greedy(model, s.output_ids, greedy_reference[q])


def test_prefix_cache_hit_equals_no_cache(model, make_model_engine, greedy_reference):
    engine = make_model_engine()
    q0, q1 = QUESTIONS[0], QUESTIONS[1]
    [first] = engine.generate([chat_ids(model, q0)], GREEDY)
    [second] = engine.generate([chat_ids(model, q1)], GREEDY)  # shares the system-prompt prefix
    [again] = engine.generate([chat_ids(model, q0)], GREEDY)  # whole prompt cached but the last block
    assert first.num_cached == 0
    assert second.num_cached >= 16 and again.num_cached > second.num_cached
    for seq, q in ((first, q0), (second, q1), (again, q0)):
        assert_same_greedy(model, seq.output_ids, greedy_reference[q])
    assert engine.blocks.hit_rate() > 0


def test_chunked_prefill_equals_whole(model, make_model_engine, greedy_reference):
    engine = make_model_engine(max_step_tokens=7, enable_prefix_cache=False)
    seqs = engine.generate([chat_ids(model, q) for q in QUESTIONS[:2]], GREEDY)
    for s, q in zip(seqs, QUESTIONS[:2]):
        assert_same_greedy(model, s.output_ids, greedy_reference[q])


def test_a_short_prompt_passes_a_long_one_and_each_counts_only_its_own_steps(smollm, make_engine):
    import time

    engine = make_engine(max_step_tokens=16, enable_prefix_cache=False)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("long", list(range(100, 140)), one)
    walls, finished = [], {}
    while engine.has_work():
        if len(walls) == 1:
            engine.add_request("short", list(range(200, 205)), one)  # arrives during the long prefill
        t = time.perf_counter()
        outs = engine.step()
        walls.append(time.perf_counter() - t)
        finished.update({o.request_id: (len(walls), o.compute_s) for o in outs if o.finish_reason})
    # steps: long 16; short 5 alone (not padded with the long one); long 16; long 8 and its first token
    assert finished["short"][0] == 2 and finished["long"][0] == 4
    short_s, long_s = finished["short"][1], finished["long"][1]
    assert short_s <= walls[1] and long_s <= walls[0] + walls[2] + walls[3]
    assert short_s + long_s == pytest.approx(sum(walls), rel=0.2)


def test_long_chunks_take_the_dequantize_path_and_agree(model, make_model_engine, greedy_reference, monkeypatch):
    """Chunks longer than the kernel's limit are computed by dequantize + MKL: still the same answers."""
    from engine.linear_paths import KERNELS

    monkeypatch.setattr(KERNELS, "kernel_max_chunk", 8)
    engine = make_model_engine(enable_prefix_cache=False)
    seqs = engine.generate([chat_ids(model, q) for q in QUESTIONS], GREEDY)
    for s, q in zip(seqs, QUESTIONS):
        assert_same_greedy(model, s.output_ids, greedy_reference[q])


def test_preemption_and_resume_identical(model, make_model_engine, greedy_reference):
    # Prompts take 3 blocks each and grow into a 4th; 7 blocks cannot hold two growing sequences.
    engine = make_model_engine(num_blocks=7, block_size=16, enable_prefix_cache=False)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [chat_ids(model, q) for q in QUESTIONS[:3]]
    seqs = engine.generate(prompts, params)
    assert engine.scheduler.preemptions > 0
    for s, q in zip(seqs, QUESTIONS[:3]):
        assert_same_greedy(model, s.output_ids[: GREEDY.max_tokens], greedy_reference[q])


def test_decode_rows_of_very_different_lengths_equal_one_by_one(model, make_model_engine):
    """Contexts of ~40, ~120 and ~300 tokens decode in separate length groups (no padding to the longest)."""
    from engine.model_runner import length_groups

    prompts = [chat_ids(model, "Hi."), chat_ids(model, "Tell me about the sea. " * 12),
               chat_ids(model, "Describe a forest in autumn. " * 40)]
    lens = [len(p) for p in prompts]
    assert len(length_groups(lens, 16)) == 3
    alone = []
    for p in prompts:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
        [seq] = make_model_engine(enable_prefix_cache=False).generate([p], params)
        alone.append((seq.output_ids, [lp.top[0][1] - lp.top[1][1] for lp in seq.logprobs]))
    together = make_model_engine(enable_prefix_cache=False).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for seq, want in zip(together, alone):
        assert_same_greedy(model, seq.output_ids, want)


def test_length_groups_bound_the_padding():
    from engine.model_runner import MAX_GROUPS, length_groups

    assert length_groups([100, 110, 120], 16) is None  # similar: one group, no regrouping
    groups = length_groups([10, 300, 12, 290, 80, 95], 16)
    assert sorted(i for rows, _ in groups for i in rows) == list(range(6))
    for rows, longest in groups:
        assert longest == max([10, 300, 12, 290, 80, 95][i] for i in rows)
    assert [sorted(rows) for rows, _ in groups] == [[0, 2], [4, 5], [1, 3]]
    assert len(length_groups(list(range(1, 4000, 97)), 16)) == MAX_GROUPS


def test_block_size_does_not_change_output(model, make_model_engine, greedy_reference):
    engine = make_model_engine(block_size=8, num_blocks=64)
    [seq] = engine.generate([chat_ids(model, QUESTIONS[3])], GREEDY)
    assert_same_greedy(model, seq.output_ids, greedy_reference[QUESTIONS[3]])


def test_seed_reproducible_and_varies(smollm, make_engine):
    engine = make_engine()
    ids = chat_ids(smollm, "Tell me a short story about a cat.")
    p = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in (7, 7, 8)]
    a, b, c = engine.generate([ids, ids, ids], p)
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids


def test_stop_string_across_tokens(smollm, make_engine, reference):
    engine = make_engine()
    ids = chat_ids(smollm, QUESTIONS[0])
    full = smollm.tokenizer.decode(reference[QUESTIONS[0]])
    assert "France is" in full
    stop = "ce is"  # spans the boundary between "France" and " is"
    [seq] = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]))
    assert seq.finish_reason == "stop"
    assert seq.text == full[: full.index(stop)]


def test_streamed_text_never_passes_stop(smollm, make_engine):
    engine = make_engine()
    seq = engine.add_request("s", chat_ids(smollm, QUESTIONS[0]),
                             SamplingParams(max_tokens=12, temperature=0.0, stop=["Paris"]))
    streamed = ""
    while not seq.finished:
        for out in engine.step():
            streamed += out.text
    assert "Paris" not in streamed and "Par" not in streamed
    assert streamed == seq.text


MULTILINGUAL = "Grüße aus Köln 🙂 — 日本語のテキスト 🎉 done. " * 20


def force_tokens(engine, seq, forced: list[int]) -> list[str]:
    """Append ``forced`` as if sampled, until the sequence finishes; the text delta of each step."""
    deltas = []
    for tok in forced:
        out = engine.append_token(seq, tok)
        deltas.append(out.text)
        if out.finish_reason:
            break
    return deltas


@pytest.mark.parametrize("stop", [None, "テキスト 🎉 done. Gr"])
def test_streamed_text_is_whole_characters(smollm, make_engine, stop):
    """Forced tokens that split characters: every delta is whole characters, the sum is the text."""
    engine = make_engine()
    forced = smollm.tokenizer.encode(MULTILINGUAL)
    assert any("\ufffd" in smollm.tokenizer.decode([t]) for t in forced)  # some tokens are part-characters
    seq = engine.add_request("u", [1, 2, 3], SamplingParams(max_tokens=len(forced), stop=[stop] if stop else []))
    deltas = force_tokens(engine, seq, forced)
    assert not any("\ufffd" in d for d in deltas)
    if stop:
        assert seq.finish_reason == "stop" and "".join(deltas) == MULTILINGUAL[: MULTILINGUAL.index(stop)]
    else:
        assert seq.finish_reason == "length" and "".join(deltas) == MULTILINGUAL == seq.text
    engine.abort("u")


def byte_fallback_tokenizer():
    """A Llama-2-style decoder: each byte of an unfinished character decodes to its own U+FFFD."""
    from tokenizers import Tokenizer, decoders, models

    from engine.tokenizer import TextTokenizer

    vocab = {"<unk>": 0, "a": 1, "b": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return TextTokenizer(tok, eos_ids=set())


@pytest.mark.parametrize("stop", ["😀", "a😀"])
def test_stop_string_found_when_pending_bytes_shrink_the_text(make_engine, stop):
    """'a���' becomes 'a😀' when the last byte comes: the stop is found at that token, not a token later."""
    engine = make_engine()
    engine.tokenizer = byte_fallback_tokenizer()
    forced = engine.tokenizer.encode("a😀b")
    seq = engine.add_request("bf", [1, 2, 3], SamplingParams(max_tokens=10, stop=[stop]))
    deltas = force_tokens(engine, seq, forced)
    assert seq.finish_reason == "stop"
    assert len(deltas) == len(forced) - 1  # stopped at the emoji's last byte, before "b"
    assert "".join(deltas) == seq.text == "a😀b"[: "a😀b".index(stop)]
    engine.abort("bf")


def test_cached_tokens_after_preemption_count_only_prompt_cache_hits(make_engine):
    """A preempted sequence re-matches its own blocks when it resumes; usage must not call that a cache hit."""
    engine = make_engine(block_size=4, num_blocks=7, speculative="off")  # a draft would finish p2 in time
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    engine.add_request("p1", [11, 12, 13], params)
    engine.add_request("p2", [21, 22, 23], params)
    finals = {}
    for _ in range(500):
        if not engine.has_work():
            break
        for out in engine.step():
            if out.finish_reason:
                finals[out.request_id] = out
    assert engine.scheduler.preemptions > 0
    assert set(finals) == {"p1", "p2"}
    for out in finals.values():
        assert 0 <= out.cached_tokens <= out.prompt_tokens, out


def test_a_remote_prompt_is_placed_held_placed_again_and_prefilled_here(smollm, make_engine):
    """A remote request waits placed (no step computes it) and its blocks go to the connector. A retry holds the fresh
    blocks under the connector's key and places the prompt again in others; a fall back computes it here, the
    same tokens as a local request; the held blocks are free once the connector releases the key."""
    from engine.kv_connector import LOCAL, RETRY, RemoteResult
    from engine.sequence import SeqStatus

    ids, params = chat_ids(smollm, QUESTIONS[0]), SamplingParams(max_tokens=6, temperature=0.0)
    [local] = make_engine().generate([ids], params)
    engine, connector = make_engine(), RecordingConnector()
    engine.connector = connector
    seq = engine.add_request("r", ids, params, remote=True)
    assert engine.step() == [] and seq.status is SeqStatus.WAITING_FOR_REMOTE_KV and seq.num_computed == 0
    first, blocks = connector.placed.pop("r")
    assert first == 0 and len(blocks) == -(-len(ids) // engine.cfg.block_size)
    assert engine.step() == [] and engine.last_plan_size == 0  # nothing computes it here
    connector.hold, connector.results = "r:0", [RemoteResult("r", RETRY)]
    assert engine.step() == []
    assert engine.quarantined == {"r:0": blocks} and set(connector.placed["r"][1]).isdisjoint(blocks)
    connector.hold, connector.results = "", [RemoteResult("r", LOCAL)]
    tokens = [t for _ in range(20) if engine.has_work() for out in engine.step() for t in out.token_ids]
    assert tokens == local.output_ids and engine.quarantined == {"r:0": blocks}
    connector.released = ["r:0"]
    engine.step()
    assert engine.quarantined == {}  # and every block is free (the fixture checks)


def test_aborting_or_dropping_a_placed_remote_prompt_holds_what_a_writer_may_touch(smollm, make_engine):
    from engine.kv_connector import DROP, RemoteResult

    ids, params = chat_ids(smollm, QUESTIONS[0]), SamplingParams(max_tokens=4)
    engine, connector = make_engine(), RecordingConnector()
    engine.connector = connector
    for rid in ("a", "b", "c"):
        engine.add_request(rid, ids, params, remote=True)
    engine.step()
    connector.hold = "a:0"
    assert engine.abort("a") and engine.quarantined == {"a:0": connector.placed["a"][1]}
    connector.hold = ""
    assert engine.abort("b") and "b" not in engine.seqs
    connector.results = [RemoteResult("c", DROP)]
    assert engine.step() == [] and not engine.has_work() and "c" not in engine.seqs
    connector.released = ["a:0"]
    engine.step()
    assert engine.quarantined == {}


def test_sequence_outgrowing_the_pool_ends_with_length(smollm, make_engine):
    """A sequence cannot grow past the pool: it ends with "length" instead of preempting itself forever."""
    engine = make_engine(num_blocks=3)  # 48 token slots
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    big = engine.add_request("big", list(range(100, 112)), params)
    after = engine.add_request("after", list(range(200, 210)), SamplingParams(max_tokens=4, temperature=0.0))
    for _ in range(200):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work()
    assert big.finish_reason == "length" and big.num_tokens == 48
    assert after.finish_reason == "length" and len(after.output_ids) == 4


def test_max_tokens_and_logprobs(smollm, make_engine):
    engine = make_engine()
    [seq] = engine.generate([chat_ids(smollm, QUESTIONS[2])],
                            SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=3))
    assert seq.finish_reason == "length" and len(seq.output_ids) == 5
    assert [lp.token_id for lp in seq.logprobs] == seq.output_ids
    for lp in seq.logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_penalties_change_output(smollm, make_engine):
    engine = make_engine()
    ids = chat_ids(smollm, "Repeat the word 'cat' twenty times.")
    plain, penalized = engine.generate(
        [ids, ids],
        [SamplingParams(max_tokens=20, temperature=0.0),
         SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)],
    )
    assert plain.output_ids != penalized.output_ids
    assert len(set(penalized.output_ids)) >= len(set(plain.output_ids))


def test_abort_frees_blocks(smollm, make_engine):
    engine = make_engine()
    engine.add_request("a", chat_ids(smollm, QUESTIONS[0]), GREEDY)
    engine.step()
    assert engine.blocks.num_used > 0
    assert engine.abort("a")
    assert not engine.has_work()


@pytest.mark.parametrize("kw,param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=3.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=9000), "max_tokens"),
])
def test_bad_requests_name_the_field(smollm, make_engine, kw, param):
    engine = make_engine()
    with pytest.raises(ValueError) as err:
        engine.add_request("bad", chat_ids(smollm, "hi"), SamplingParams(**kw))
    assert err.value.args[1] == param
    assert not engine.has_work()


def test_a_float16_kv_cache_holds_half_the_bytes_and_answers_alike(smollm, make_engine):
    """The default model's KV cache is float16 (`--kv-dtype auto` beside quantized weights): the layout (which
    peers must match) says so, a block takes half the bytes of `--kv-dtype float32`'s, and a prompt's logits
    (long chunk and decode rows) stay within float16's rounding of the float32 cache's; the greedy answer is
    the same. Float weights keep a float32 cache. On kernel path avx512_vnni the long chunk runs on avx512_bf16 (avx2
    without AVX-512 BF16) here: int8 activations turn the cache's rounding into flipped roundings of their own, layer after layer
    (the logits 6.4% apart at most, one of the three greedy tokens changed; bench.quality measures that path)."""
    import torch

    from engine import native
    from engine.engine import EngineConfig, kv_dtype_for
    from engine.quant import encode_weight, has_integer_weights

    wide, narrow = make_engine(kv_dtype="float32"), make_engine()
    assert (wide.layout.dtype, narrow.layout.dtype) == ("float32", "float16")
    assert narrow.layout != wide.layout
    assert 2 * narrow.pool.nbytes == wide.pool.nbytes
    prompt = chat_ids(smollm, "Describe the water cycle in detail, step by step, for a curious child. " * 8)
    assert len(prompt) > 150  # a long chunk, then decode rows
    cuts = [len(prompt) - 3, len(prompt) - 2, len(prompt) - 1]
    here = native.kernel_path()
    if here == "avx512_vnni":  # the panels of a long chunk, in bfloat16 where the CPU has it
        native.use_kernel_path(next(p for p in ("avx512_bf16", "avx2") if p in native.kernel_paths()))
    try:
        a, b = wide.prompt_logits(prompt, cuts), narrow.prompt_logits(prompt, cuts)
    finally:
        if here == "avx512_vnni":
            native.use_kernel_path(here)
    assert 0 < (a - b).abs().max() < 0.02 * a.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    params = SamplingParams(max_tokens=24, temperature=0.0)
    question = chat_ids(smollm, "What is the capital of France?")
    assert wide.generate([question], params)[0].output_ids == narrow.generate([question], params)[0].output_ids
    with pytest.raises(ValueError, match="kv dtype"):
        make_engine(kv_dtype="int3")
    assert [kv_dtype_for(q, EngineConfig(dtype=d)) for q, d in ((False, "float32"), (True, "float32"),
                                                                (True, "bfloat16"))] \
        == ["float32", "float16", "bfloat16"]
    assert kv_dtype_for(False, EngineConfig(kv_dtype="float16")) == "float16"
    assert smollm.quantized
    for kind, quantized in (("none", False), ("fp16", False), ("int8", True), ("int4", True)):
        assert has_integer_weights(encode_weight(torch.randn(64, 64), kind, "w")) == quantized, kind
