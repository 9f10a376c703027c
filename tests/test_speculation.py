"""Speculative decoding by prompt lookup: the drafts, the rule that keeps them (the target's distribution), and
the engine's tokens with it on equal to those with it off."""

from __future__ import annotations

import collections

import pytest
import torch

from bench.speculation import copy_prompts
from engine.engine import EngineConfig, LLMEngine
from engine.params import SamplingParams
from engine.sampling import Sampler
from engine.sequence import Sequence
from engine.speculation import PromptLookup, SpeculationConfig, StepCost, draft_length, kept
from tests.harness.chat import chat_ids


def test_prompt_lookup_drafts_what_followed_the_longest_tail():
    drafter = PromptLookup(SpeculationConfig(max_draft=8, step_rows=1e9))  # rows for free: the longest draft
    seq = Sequence("s", [1, 2, 3, 9, 7, 2, 3, 8, 4, 5, 1, 2, 3], SamplingParams())
    assert drafter.draft(seq, room=8, batch=1) == [9, 7, 2, 3, 8, 4, 5, 1]  # (1, 2, 3) beats the later (2, 3)
    assert seq.spec.tail == 3
    assert drafter.draft(seq, room=3, batch=1) == [9, 7, 2]
    seq.output_ids += [6, 6]  # (3, 6, 6), (6, 6): never seen before
    assert drafter.draft(seq, room=8, batch=1) == []
    seq.output_ids += [4, 5]  # the index grew with the output: (6, 6, 4, 5) no, (4, 5) yes
    assert drafter.draft(seq, room=8, batch=1) == [1, 2, 3, 6, 6, 4, 5] and seq.spec.tail == 2
    with pytest.raises(ValueError, match="ngram, off"):
        SpeculationConfig("eagle")


def test_draft_length_follows_acceptance_and_the_measured_row_cost():
    """Tokens per unit of step cost: no draft where a row costs much and drafts are seldom kept, long drafts
    where they are kept. A row's cost comes from the engine's own steps; a sequence's acceptance from its
    recent drafts on top of the engine's for the same tail length."""
    def linear(row_cost: float):
        return lambda k: 1.0 + row_cost * k

    assert draft_length(0.3, linear(0.45), 8) == 0 and draft_length(0.5, linear(0.45), 8) == 1
    assert draft_length(0.9, linear(0.45), 8) == 3 and draft_length(0.99, linear(0.45), 8) == 8
    assert draft_length(0.9, linear(0.1), 8) == 8 and draft_length(0.9, linear(0.45), 2) == 2
    cost = StepCost(default_rows=1.5)
    assert cost.relative(1)(1) == 1 + 1 / 2.5
    for _ in range(10):
        cost.observe(1, 0.008)  # steps of one size say nothing of a row's cost
    assert cost.step_rows() == 1.5
    for rows in (2, 3, 5, 9) * 5:
        cost.observe(rows, 0.004 + 0.004 * rows)  # F = 4 ms, r = 4 ms: a step costs one row more than its rows
    assert cost.step_rows() == pytest.approx(1.0, rel=0.05)
    # a size that ran is priced by its own steps (1 row's stale 8 ms has decayed), others by the line
    assert cost.relative(4)(1) == pytest.approx((0.004 + 0.004 * 8) / (0.004 + 0.004 * 4), rel=0.05)
    assert cost.relative(2)(1) == pytest.approx(0.02 / 0.012)
    assert 1 < cost.relative(1)(1) < cost.relative(8)(1) < 2  # relative to a token, a row costs more in a larger batch
    for rows in (4, 8) * 10:  # the packed int8 kernels: 4 rows cost one weight pass, 8 rows twice that
        cost.observe(rows, 0.006 * (rows // 4))
    assert cost.relative(4)(1) == pytest.approx(2.0)
    assert draft_length(0.8, cost.relative(4), 8) == 0  # the line alone would have drafted here

    drafter = PromptLookup(SpeculationConfig())
    seq = Sequence("s", [1, 2, 3, 4, 5, 6, 1, 2, 3], SamplingParams())
    assert drafter.acceptance(drafter.state(seq), 3) == pytest.approx(5 / 7)  # the engine's prior, alone
    assert drafter.draft(seq, room=8, batch=1) == [4, 5]
    drafter.verified(seq, drafted=2, accepted=2)
    drafter.verified(seq, drafted=4, accepted=4)
    assert drafter.acceptance(seq.spec, 3) > 0.85 and len(drafter.draft(seq, room=8, batch=1)) >= 3
    assert drafter.draft(seq, room=8, batch=8) == [4, 5]  # the same odds pay for fewer rows in a batch of 8
    for _ in range(8):
        drafter.verified(seq, drafted=2, accepted=0)
    assert drafter.draft(seq, room=8, batch=1) == []
    assert (drafter.drafted, drafter.accepted) == (22, 6)
    fresh = Sequence("t", [1, 2, 3, 4, 5, 6, 1, 2, 3], SamplingParams())
    assert drafter.acceptance(drafter.state(fresh), 3) < 5 / 7  # the engine learned that 3-token tails mislead


def test_kept_tokens_follow_the_target_distribution():
    """Each row drawn as plain decoding draws, a draft token standing only where it equals that draw: the first
    token has the first row's distribution, a draft token stands with the probability the target gives it, and
    the token after a kept one has the second row's."""
    trials, draft = 20000, [2, 4]
    p0 = torch.tensor([0.1, 0.2, 0.4, 0.05, 0.25])
    p1 = torch.tensor([0.3, 0.05, 0.05, 0.2, 0.4])
    logits = torch.cat([p0.log().expand(trials, 5), p1.log().expand(trials, 5)])
    params = [SamplingParams(temperature=1.0)] * (2 * trials)
    tokens, _ = Sampler()(logits, params, [[]] * (2 * trials), [None] * (2 * trials))
    firsts, seconds, held = collections.Counter(), collections.Counter(), 0
    for i in range(trials):
        rows = [tokens[i], tokens[trials + i]]
        n = kept(draft, rows)
        emitted = rows[:n + 1]
        firsts[emitted[0]] += 1
        if n >= 1:
            held += 1
            seconds[emitted[1]] += 1
    assert max(abs(firsts[t] / trials - p0[t].item()) for t in range(5)) < 0.02
    assert abs(held / trials - p0[2].item()) < 0.02
    assert max(abs(seconds[t] / held - p1[t].item()) for t in range(5)) < 0.03


@pytest.fixture(scope="module")
def float_model():
    from engine.loader import load_model
    from engine.model_files import DEFAULT_MODEL

    return load_model(DEFAULT_MODEL, "float32", "none")


def both(model, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], alone: bool = False,
         **cfg) -> tuple[list[Sequence], list[Sequence], LLMEngine]:
    """The prompts generated with speculation on and off, as one batch or each `alone` (where a draft pays
    soonest: a batch of several starts drafting only once a sequence's drafts have proved themselves)."""
    on = LLMEngine(model, EngineConfig(num_blocks=cfg.pop("num_blocks", 128), speculative="ngram", **cfg))
    off = LLMEngine(model, EngineConfig(num_blocks=on.cfg.num_blocks, speculative="off", **cfg))
    plist = params if isinstance(params, list) else [params] * len(prompts)
    if alone:
        got = [on.generate([p], q)[0] for p, q in zip(prompts, plist)]
    else:
        got = on.generate(prompts, plist)
    want = off.generate(prompts, plist)
    for e in (on, off):
        e.blocks.check_idle()
    return got, want, on


def copies(model) -> list[list[int]]:
    return [chat_ids(model, p) for p in copy_prompts()]


def test_greedy_and_seeded_tokens_equal_with_speculation_off(float_model):
    prompts = copies(float_model)
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    got, want, on = both(float_model, prompts[:1], greedy)
    assert got[0].output_ids == want[0].output_ids and len(got[0].output_ids) == 64
    assert on.drafter.accepted > 16  # it did speculate: most of the copy came from drafts
    assert [lp.token_id for lp in got[0].logprobs] == got[0].output_ids
    for a, b in zip(got[0].logprobs, want[0].logprobs):
        assert abs(a.logprob - b.logprob) < 1e-3
    # seeded sampling, penalties (each row's history holds the draft before it) and a batch of four
    sampled = [SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=s, frequency_penalty=0.3 * (s % 2))
               for s in range(4)]
    got, want, on = both(float_model, prompts, sampled, alone=True)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert on.drafter.accepted > 0
    got, want, on = both(float_model, prompts, sampled)  # a batch: drafts or not, the same tokens
    assert [s.output_ids for s in got] == [s.output_ids for s in want]


def test_stops_and_limits_cut_a_kept_draft_where_plain_decoding_stops(float_model):
    [prompt] = copies(float_model)[:1]
    [ref] = LLMEngine(float_model, EngineConfig(num_blocks=64, speculative="off")).generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0.0))
    words = ref.text.split()
    stop = " ".join(words[6:8])  # a stop string inside text the drafts copy
    for params in (SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]),
                   SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)):
        got, want, _ = both(float_model, [prompt], params)
        assert (got[0].output_ids, got[0].text, got[0].finish_reason) == \
            (want[0].output_ids, want[0].text, want[0].finish_reason)
    assert got[0].finish_reason == "length" and len(got[0].output_ids) == 11


def test_a_pool_too_small_for_every_draft_preempts_and_still_agrees(float_model):
    prompts = copies(float_model)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    got, want, on = both(float_model, prompts, params, num_blocks=24, block_size=8)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert on.scheduler.preemptions > 0


def test_the_default_weights_agree_but_at_near_ties(smollm):
    """The default quantized kernels round a multi-row step differently from a one-row one (issue: batch
    invariance), so a draft's row may flip a near tie; anywhere else the tokens are plain decoding's."""
    prompts = copies(smollm)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    got, want, on = both(smollm, prompts, params, alone=True)
    assert on.drafter.accepted > 0
    for a, b in zip(got, want):
        for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)):
            if x != y:
                margin = b.logprobs[i].top[0][1] - b.logprobs[i].top[1][1]
                assert margin < 1.0, f"token {i}: {x}, not {y}, at a margin of {margin:.2f}"
                break


def test_grammar_fast_forward_writes_what_plain_decoding_writes(float_model):
    """The tokens a schema forces (long keys, braces) are drafts every row's mask verifies: the same JSON and
    tokens as with speculation off, in fewer steps."""
    import json

    from engine.params import Grammar

    schema = {"type": "object", "additionalProperties": False,
              "required": ["customer_full_name", "shipping_address_first_line", "preferred_delivery_weekday"],
              "properties": {"customer_full_name": {"type": "string", "maxLength": 20},
                             "shipping_address_first_line": {"type": "string", "maxLength": 30},
                             "preferred_delivery_weekday": {"enum": ["Monday", "Wednesday", "Friday"]}}}
    prompt = chat_ids(float_model, "Ann Lee lives at 4 Elm Road and wants Friday deliveries. Give her order as JSON.")
    params = [SamplingParams(max_tokens=120, temperature=t, seed=5, grammar=Grammar(kind="json_schema",
                                                                                 value=json.dumps(schema)))
              for t in (0.0, 0.9)]
    got, want, on = both(float_model, [prompt, prompt], params)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    for s in got:
        assert set(json.loads(s.text)) == set(schema["required"]) and s.finish_reason == "stop"
    assert on.drafter.accepted > 20  # the keys came as drafts
