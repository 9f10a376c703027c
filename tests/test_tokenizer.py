"""Tokenizer and chat template against transformers' independent GGUF tokenizer."""

from __future__ import annotations

import pytest

SAMPLES = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n\nmore",
    "digits 1234567890 and 3.14159 and 2026-11-29",
    "CJK: 你好，世界。日本語のテキスト。한국어",
    "emoji: 🙂🚀👩‍👩‍👧 and ünïcödé",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # code\n",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm):
    transformers = pytest.importorskip("transformers")
    path = smollm.path
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(smollm, text):
    tok = smollm.tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special=False) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_ids_match_transformers(smollm, hf_tokenizer, text):
    assert smollm.tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


def test_digits_split_one_by_one(smollm):
    tok = smollm.tokenizer
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")


def test_control_tokens_are_special(smollm):
    tok = smollm.tokenizer
    ids = tok.encode("<|im_start|>")
    assert len(ids) == 1
    assert tok.decode(ids) == ""  # skipped as special when decoding output
    assert tok.eog_ids >= {ids[0] + 1}  # <|im_end|> ends generation


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "2+2?"},
        ],
    ],
)
def test_chat_template_ids_match_transformers(smollm, hf_tokenizer, messages):
    ours = smollm.tokenizer.encode(smollm.chat_template.render(messages))
    theirs = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(theirs, dict) or hasattr(theirs, "input_ids"):
        theirs = theirs["input_ids"]
    assert ours == list(theirs)


def test_default_system_prompt(smollm):
    text = smollm.chat_template.render([{"role": "user", "content": "x"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")
