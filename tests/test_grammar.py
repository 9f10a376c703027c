"""engine: structured output with the real model and llguidance — the batched sampler's mask, whole
outputs that parse against their schema (greedy and sampled, mixed in one batch with free rows), the
grammar following a migrated stream's resumed tokens, and grammars refused before they run."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine.grammar import GrammarCompiler, GrammarError, check_grammar
from engine.params import Grammar, SamplingParams
from engine.sampling import Sampler
from tests.harness.chat import chat_ids
from tests.harness.json_schemas import CITY, PERSON

SCHEMAS = [("person", PERSON, "Describe a famous scientist as JSON."),
           ("city", CITY, "Describe Paris as JSON."),
           ("answer", {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                                        "reason": {"type": "string", "maxLength": 60}},
                       "required": ["answer", "reason"], "additionalProperties": False},
            "Is the sky blue? Answer as JSON.")]


def schema_grammar(schema: dict) -> Grammar:
    return Grammar(kind="json_schema", value=json.dumps(schema))


@pytest.fixture(scope="module")
def compiler(smollm) -> GrammarCompiler:
    tok = smollm.tokenizer
    return GrammarCompiler(tok.tok.to_str(), smollm.config.vocab_size, sorted(tok.eog_ids))


def test_sampler_masks_only_the_rows_with_a_grammar(smollm, compiler) -> None:
    vocab = smollm.config.vocab_size
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g) * 5
    digits = compiler.compile(Grammar(kind="regex", value="[0-9]+"))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.5, seed=3)]
    free, _ = Sampler()(logits.clone(), params, [[], [], []], [None, None, torch.Generator().manual_seed(3)])
    masked, _ = Sampler()(logits.clone(), params, [[], [], []], [None, None, torch.Generator().manual_seed(3)],
                          [None, digits, compiler.compile(Grammar(kind="regex", value="[0-9]+"))])
    assert masked[0] == free[0]  # the row without a grammar is untouched
    for tok in masked[1:]:
        assert smollm.tokenizer.decode([tok]).isdigit(), tok
    assert not smollm.tokenizer.decode([free[1]]).isdigit()  # (so the mask, not luck, made them digits)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_parse_against_their_schemas_in_a_mixed_batch(make_engine, smollm, temperature: float) -> None:
    engine = make_engine()
    prompts, params = [], []
    for i, (_, schema, question) in enumerate(SCHEMAS):
        prompts.append(chat_ids(smollm, question))
        params.append(SamplingParams(max_tokens=200, temperature=temperature, seed=11 + i,
                                     grammar=schema_grammar(schema)))
    prompts.append(chat_ids(smollm, "Say hello."))  # a free row in the same batch
    params.append(SamplingParams(max_tokens=8, temperature=temperature, seed=5))
    seqs = engine.generate(prompts, params)
    for (name, schema, _), seq in zip(SCHEMAS, seqs):
        assert seq.finish_reason == "stop", (name, seq.text)
        jsonschema.validate(json.loads(seq.text), schema)
    assert seqs[-1].output_ids


def test_json_object_is_one_object(make_engine, smollm) -> None:
    [seq] = make_engine().generate([chat_ids(smollm, "Give me some data.")],
                                   SamplingParams(max_tokens=200, temperature=0.0, grammar=Grammar(kind="json_object")))
    assert isinstance(json.loads(seq.text), dict), seq.text


def test_resumed_tokens_advance_the_grammar(make_engine, smollm) -> None:
    """A migrated stream replays its tokens through the grammar: the rest still parses, and tokens the
    grammar refuses are a clear error (they cannot have come from this request)."""
    prompt = chat_ids(smollm, "Describe a famous scientist as JSON.")
    params = SamplingParams(max_tokens=120, temperature=0.0, grammar=schema_grammar(PERSON))
    first, second = make_engine(), make_engine()
    [whole] = first.generate([prompt], params)
    for k in (1, 5):
        seq = second.add_request(f"moved-{k}", prompt, params, resume_ids=whole.output_ids[:k])
        while not seq.finished:
            second.step()
        assert json.loads(seq.text) == json.loads(whole.text)
    wrong = smollm.tokenizer.encode("hello")
    with pytest.raises(ValueError, match="grammar") as e:
        second.add_request("moved-wrong", prompt, params, resume_ids=wrong)
    assert e.value.args[1] == "resume_ids"


def test_bad_grammars_are_refused_before_they_run(make_engine, smollm) -> None:
    with pytest.raises(GrammarError):
        check_grammar(Grammar(kind="json_schema", value="{not json"))
    with pytest.raises(GrammarError):
        check_grammar(schema_grammar({"type": "object", "properties": {"a": {"type": "nonsense"}}}))
    with pytest.raises(GrammarError):
        check_grammar(Grammar(kind="lark", value="start: undefined_rule"))
    engine = make_engine()
    with pytest.raises(ValueError):  # the engine checks again where it accepts a request
        engine.check_request(chat_ids(smollm, "x"), SamplingParams(grammar=Grammar(kind="regex", value="(")))
