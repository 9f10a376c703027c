"""Tokenizer: a `tokenizers` BPE built from GGUF metadata or loaded from tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# GGUF token types (llama.cpp): 3 = control, 4 = user-defined.
_CONTROL, _USER_DEFINED = 3, 4

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


class TextTokenizer:
    """Encode/decode plus the ids the engine needs: end-of-generation set and special tokens."""

    def __init__(self, tok: Tokenizer, eos_ids: set[int], bos_id: int | None = None):
        self.tok = tok
        self.bos_id = bos_id
        self.declared_eos_ids = set(eos_ids)
        vocab = tok.get_vocab(with_added_tokens=True)
        self.eog_ids = set(eos_ids) | {vocab[n] for n in _EOG_NAMES if n in vocab}
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> TextTokenizer:
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') is supported; "
                "use the model's Hugging Face directory (tokenizer.json) instead"
            )
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre", "gpt2"))
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([
            AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL
        ])
        tok.add_tokens([
            AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED
        ])
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eot = fields.get("tokenizer.ggml.eot_token_id")
        return cls(tok, {i for i in (eos, eot) if i is not None}, fields.get("tokenizer.ggml.bos_token_id"))

    @classmethod
    def from_hf_dir(cls, path: Path, eos_ids: set[int]) -> TextTokenizer:
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        bos_id = None
        cfg_path = path / "tokenizer_config.json"
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text())
            for key in ("eos_token", "bos_token"):
                name = cfg.get(key)
                if isinstance(name, dict):
                    name = name.get("content")
                tid = tok.token_to_id(name) if name else None
                if tid is not None and key == "eos_token":
                    eos_ids = eos_ids | {tid}
                elif tid is not None:
                    bos_id = tid
        return cls(tok, eos_ids, bos_id)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; control-token text such as <|im_start|> maps to its id. No BOS is added."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token_text(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False)

    def id_to_token(self, tid: int) -> str | None:
        return self.tok.id_to_token(tid)
