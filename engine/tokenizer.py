"""Tokenizer: a `tokenizers` BPE built from GGUF metadata or loaded from tokenizer.json.

Two GGUF vocabularies are rebuilt from their metadata, each to give llama.cpp's ids for any text:

- ``gpt2``: byte-level BPE with the file's merges, split first by the ``tokenizer.ggml.pre`` regex.
- ``llama``: SentencePiece-style BPE (Gemma, Llama 2, Mistral): tokens with scores, no merges. llama.cpp
  (``llm_tokenizer_spm``) turns each space into U+2581, starts from UTF-8 characters, and merges again and
  again the adjacent pair whose concatenation is a token with the highest score (ties: leftmost); what
  stays no token is written as byte tokens ``<0xXX>``. That is BPE with one merge per way of cutting a
  token in two known pieces, ranked by the score of the token it makes, plus byte fallback.

In both, control tokens (type 3) and user-defined ones (type 4), for ``llama`` also unknown ones (type 2), are
matched whole in the raw text first.

Where the ``llama`` rebuild could still differ from llama.cpp (neither shows on any text tried against
llama-server, see tests/test_tokenizer_spm.py): llama.cpp matches special tokens longest first over the whole
text, `tokenizers` leftmost-longest -- the same unless two of them overlap, and no two of Gemma 3's do; and
llama.cpp breaks a tie of equal scores by position for any two pairs, BPE only for the same pair -- two
different tokens of equal score (Gemma 3's normal tokens all have distinct scores), or one token cut two ways
in a periodic text (x+y = y+z, both pairs pending at once).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

# GGUF token types (llama.cpp): 2 = unknown, 3 = control, 4 = user-defined.
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space
_SUPPORTED_MODELS = "'gpt2' (byte-level BPE) and 'llama' (SentencePiece-style BPE)"

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# End-of-generation tokens recognised by name, besides the declared EOS (as llama.cpp does).
_EOG_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "</s>", "<end_of_turn>")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in ("gpt2", "default", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3", "smaug-bpe", "dbrx"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
            byte_level,
        ])
    raise ValueError(f"unsupported GGUF tokenizer pre-split {pre!r} (supported: smollm, gpt2, llama-bpe)")


def _spm_merges(vocab: dict[str, int], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """Every cut of a token into two tokens, the cuts of higher-scored tokens first (ties: lower id).

    llama.cpp merges any adjacent pair that makes a token, by that token's score; within a text fragment
    that can only be a token that is not matched whole beforehand (control, user-defined, unknown), so
    those make no merges. Cuts of one token keep the order of their cut point; two cuts of the same token
    compete only in rare periodic texts (x+y = y+z), where llama.cpp takes the leftmost pair.
    """
    made = [(t, i) for t, i in vocab.items() if types[i] not in (_UNKNOWN, _CONTROL, _USER_DEFINED) and len(t) > 1]
    made.sort(key=lambda ti: (-scores[ti[1]], ti[1]))
    merges = []
    for t, _ in made:
        for k in range(1, len(t)):
            left = t[:k]
            if left in vocab:
                right = t[k:]
                if right in vocab:
                    merges.append((left, right))
    return merges


def _spm_model(fields: dict, tokens: list[str], types: list[int]) -> Tokenizer:
    scores: list[float] = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab, merges=_spm_merges(vocab, types, scores),
        unk_token=tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None,
        byte_fallback=True, fuse_unk=False,  # llama.cpp writes one <0xXX> per byte, never one fused <unk>
    )
    tok = Tokenizer(model)
    replace = normalizers.Replace(" ", _SPACE)
    # llama.cpp puts a space before each fragment that starts the text or follows a matched special token;
    # those are exactly the pieces the normalizer sees one at a time.
    prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if prefix else replace
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


class TextTokenizer:
    """Encode/decode plus the ids the engine needs: end-of-generation set and special tokens."""

    def __init__(self, tok: Tokenizer, eos_ids: set[int], bos_id: int | None = None, add_bos: bool = False):
        """`add_bos`: the model wants BOS before a prompt (`encode_prompt`)."""
        self.tok = tok
        self.bos_id = bos_id
        self.add_bos = add_bos and bos_id is not None
        # byte-level BPE spells bytes as characters (GPT-2's map); SentencePiece-style pieces are text with U+2581
        # for a space and <0xXX> byte tokens (gateway.textmodel.TokenBytes reads a token's bytes either way)
        self.byte_level = tok.decoder is not None and b'"ByteLevel"' in tok.decoder.__getstate__()
        self.declared_eos_ids = set(eos_ids)
        vocab = tok.get_vocab(with_added_tokens=True)
        self.eog_ids = set(eos_ids) | {vocab[n] for n in _EOG_NAMES if n in vocab}
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> TextTokenizer:
        kind = fields.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r} (tokenizer.ggml.model): supported are {_SUPPORTED_MODELS}; "
                "use the model's Hugging Face directory (tokenizer.json) instead"
            )
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        pre = fields.get("tokenizer.ggml.pre", "gpt2")
        if kind == "gpt2":
            merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
            vocab = {t: i for i, t in enumerate(tokens)}
            tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
            tok.pre_tokenizer = _pre_tokenizer(pre)
            tok.decoder = decoders.ByteLevel()
            # llama.cpp's defaults when the file does not say: BOS only for the Llama 3 family
            add_bos_default = pre in ("llama-bpe", "llama3", "smaug-bpe", "dbrx")
            special = (_CONTROL,)
        else:
            tok = _spm_model(fields, tokens, types)
            add_bos_default = True
            special = (_CONTROL, _UNKNOWN)  # llama.cpp matches <unk> (Llama 2's is type 2) whole too
        tok.add_special_tokens([
            AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in special
        ])
        tok.add_tokens([
            AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED
        ])
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eot = fields.get("tokenizer.ggml.eot_token_id")
        bos = fields.get("tokenizer.ggml.bos_token_id")
        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default))
        return cls(tok, {i for i in (eos, eot) if i is not None}, bos, add_bos)

    @classmethod
    def from_hf_dir(cls, path: Path, eos_ids: set[int]) -> TextTokenizer:
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        bos_id = None
        add_bos = False
        cfg_path = path / "tokenizer_config.json"
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text())
            add_bos = bool(cfg.get("add_bos_token", False))
            for key in ("eos_token", "bos_token"):
                name = cfg.get(key)
                if isinstance(name, dict):
                    name = name.get("content")
                tid = tok.token_to_id(name) if name else None
                if tid is not None and key == "eos_token":
                    eos_ids = eos_ids | {tid}
                elif tid is not None:
                    bos_id = tid
        return cls(tok, eos_ids, bos_id, add_bos)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; control-token text such as <|im_start|> maps to its id. No BOS is added."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a prompt as the model reads it: BOS first where the model wants one (as llama.cpp adds it),
        unless the text (a rendered chat template) begins with it already."""
        ids = self.encode(text)
        if self.add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token_text(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False)

    def id_to_token(self, tid: int) -> str | None:
        return self.tok.id_to_token(tid)
