"""Engine invariants on the real default model: batching, paging, prefix cache, chunking, preemption."""

from __future__ import annotations

import pytest

from engine.sampling import SamplingParams
from tests.conftest import chat_ids

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the moon.",
    "What is 12 times 12?",
]


@pytest.fixture(scope="module")
def reference(smollm):
    """Greedy output of each question run alone, no prefix cache."""
    from engine.engine import EngineConfig, LLMEngine

    engine = LLMEngine(smollm, EngineConfig(num_blocks=64, enable_prefix_cache=False))
    out = {}
    for q in QUESTIONS:
        [seq] = engine.generate([chat_ids(smollm, q)], GREEDY)
        out[q] = seq.output_ids
    engine.blocks.check_idle()
    return out


def test_capital_of_france(smollm, make_engine):
    [seq] = make_engine().generate([chat_ids(smollm, "What is the capital of France?")],
                                   SamplingParams(max_tokens=32, temperature=0.0))
    assert "Paris" in seq.text
    assert seq.finish_reason == "stop"


def test_batched_equals_one_by_one(smollm, make_engine, reference):
    engine = make_engine(enable_prefix_cache=False)
    seqs = engine.generate([chat_ids(smollm, q) for q in QUESTIONS], GREEDY)
    assert [s.output_ids for s in seqs] == [reference[q] for q in QUESTIONS]


def test_prefix_cache_hit_equals_no_cache(smollm, make_engine, reference):
    engine = make_engine()
    q0, q1 = QUESTIONS[0], QUESTIONS[1]
    [first] = engine.generate([chat_ids(smollm, q0)], GREEDY)
    [second] = engine.generate([chat_ids(smollm, q1)], GREEDY)  # shares the system-prompt prefix
    [again] = engine.generate([chat_ids(smollm, q0)], GREEDY)  # whole prompt cached but the last block
    assert first.num_cached == 0
    assert second.num_cached >= 16 and again.num_cached > second.num_cached
    assert [first.output_ids, second.output_ids, again.output_ids] == [reference[q0], reference[q1], reference[q0]]
    assert engine.blocks.hit_rate() > 0


def test_chunked_prefill_equals_whole(smollm, make_engine, reference):
    engine = make_engine(max_step_tokens=7, enable_prefix_cache=False)
    seqs = engine.generate([chat_ids(smollm, q) for q in QUESTIONS[:2]], GREEDY)
    assert [s.output_ids for s in seqs] == [reference[q] for q in QUESTIONS[:2]]


def test_preemption_and_resume_identical(smollm, make_engine, reference):
    # Prompts take 3 blocks each and grow into a 4th; 7 blocks cannot hold two growing sequences.
    engine = make_engine(num_blocks=7, block_size=16, enable_prefix_cache=False)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [chat_ids(smollm, q) for q in QUESTIONS[:3]]
    seqs = engine.generate(prompts, params)
    assert engine.scheduler.preemptions > 0
    roomy = make_engine(num_blocks=64, enable_prefix_cache=False).generate(prompts, params)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in roomy]
    for s, q in zip(seqs, QUESTIONS[:3]):
        assert s.output_ids[: len(reference[q])] == reference[q]


def test_block_size_does_not_change_output(smollm, make_engine, reference):
    engine = make_engine(block_size=8, num_blocks=64)
    [seq] = engine.generate([chat_ids(smollm, QUESTIONS[3])], GREEDY)
    assert seq.output_ids == reference[QUESTIONS[3]]


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
    engine = make_engine(block_size=4, num_blocks=7)
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


def test_abort_of_a_remote_prefill_sequence_leaves_it_to_its_owner(smollm, make_engine):
    engine = make_engine()
    seq, fresh = engine.reserve_remote("r", chat_ids(smollm, QUESTIONS[0]), SamplingParams(max_tokens=4))
    assert fresh
    with pytest.raises(RuntimeError, match="through its owner"):
        engine.abort("r")
    assert engine.abandon_remote("r", quarantine=False) == []  # and the blocks are free again (fixture checks)
    assert engine.blocks.num_free == engine.blocks.num_blocks


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
