"""A GGUF file's metadata: its config, tokenizer, chat template and sampling defaults, read without its weights.

The metadata is parsed once and cached as JSON beside the weight cache (keyed by the file's digest), so a
second start takes milliseconds. A GGUF that is not one, or is cut short, is refused with an error naming
the file and what is wrong, before anything reads past its end.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from engine import families
from engine.chat_template import CHATML, ChatTemplate
from engine.config import ModelConfig
from engine.model_cache import cache_file, write_atomic
from engine.model_text import ModelLoadError, ModelText, declared_sampling
from engine.tokenizer import TextTokenizer

_META_FORMAT = 5  # of the cached GGUF metadata: 3 = with sampling defaults, 5 = the family's graph and add_bos
#: GGUF tensor types the loader reads (engine.loader says what each becomes); others are refused by name
GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_GGUF_ROPE_SCALING = ("none", "linear")  # llama.cpp's rope.scaling.type values we implement
#: sampling defaults a model may declare in its metadata (llama.cpp's general.sampling.* keys) -> SamplingParams field
_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k", "general.sampling.penalty_repeat": "repetition_penalty"}


#: GGUF value types (gguf.GGUFValueType) read as one struct item; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _Unusual(Exception):
    """A header `_read_metadata` leaves to gguf's own reader: nested arrays, a repeated key, anything cut short."""


def _string(buf: memoryview, at: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, at)
    at += 8
    if at + length > len(buf):
        raise _Unusual("a string runs past the end of the file")
    return str(buf[at:at + length], "utf-8"), at + length


def _value(buf: memoryview, at: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(buf, at)
    if kind != _ARRAY:
        raise _Unusual(f"value type {kind}")
    item, count = struct.unpack_from("<IQ", buf, at)
    at += 12
    if item in _SCALARS:
        dtype = np.dtype("<" + _SCALARS[item])
        if at + count * dtype.itemsize > len(buf):
            raise _Unusual("an array runs past the end of the file")
        return np.frombuffer(buf, dtype, count, at).tolist(), at + count * dtype.itemsize
    if item != _STRING:
        raise _Unusual(f"an array of value type {item}")
    out = []
    for _ in range(count):
        text, at = _string(buf, at)
        out.append(text)
    return out, at


def _read_metadata(buf: memoryview, at: int, count: int) -> tuple[dict[str, Any], int, tuple[int, Any] | None]:
    """A little-endian GGUF's `count` key-value pairs from offset `at`, as the Python values
    ``ReaderField.contents()`` gives; the offset after them; and general.alignment's (type, value) if present.

    Why not gguf's reader: it makes two numpy views per string, ~2.3 s for the default model's 49,152-token
    vocabulary and ~10 s for Gemma 3's 262,144, on every first start of a GGUF; this reads them in ~0.1 s."""
    out: dict[str, Any] = {}
    alignment = None
    for _ in range(count):
        key, at = _string(buf, at)
        (kind,) = struct.unpack_from("<I", buf, at)
        if key in out:
            raise _Unusual(f"key {key} repeated")
        out[key], at = _value(buf, at + 4, kind)
        if key == "general.alignment":
            alignment = (kind, out[key])
    return out, at, alignment


def _field_values(reader) -> dict[str, Any]:
    """What gguf's reader itself made of the metadata, as Python values."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def gguf_fields(reader) -> dict[str, Any]:
    """A reader's (`open_gguf`) metadata as Python values, by key (from its own fields where a gguf release's
    reader did not call `_build_fields`)."""
    if not hasattr(reader, "metadata"):
        reader.metadata = _field_values(reader)
    return reader.metadata


def family_of_gguf(fields: dict, path: Path) -> families.Family:
    arch = fields.get("general.architecture")
    family = families.by_gguf_arch(arch)
    if family is None:
        raise ModelLoadError(f"{path.name}: unsupported architecture {arch!r} (general.architecture; supported: "
                             f"{families.supported('gguf')})")
    return family


def _gguf_config(fields: dict, path: Path) -> ModelConfig:
    family = family_of_gguf(fields, path)
    a = fields["general.architecture"]
    hidden = fields[f"{a}.embedding_length"]
    heads = fields[f"{a}.attention.head_count"]
    kv_heads = fields.get(f"{a}.attention.head_count_kv", heads)
    head_dim = fields.get(f"{a}.attention.key_length", hidden // heads)
    scaling = None
    kind = fields.get(f"{a}.rope.scaling.type", "none")
    if kind not in _GGUF_ROPE_SCALING:  # ignoring yarn or longrope would give wrong logits on long contexts
        supported = ", ".join(_GGUF_ROPE_SCALING)
        raise ModelLoadError(f"{path.name}: unsupported rope scaling type {kind!r} (supported: {supported})")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": fields.get(f"{a}.rope.scaling.factor", 1.0)}
    vocab = fields.get(f"{a}.vocab_size") or len(fields["tokenizer.ggml.tokens"])
    try:
        graph = family.gguf_config(fields, a)
    except families.FamilyConfigError as e:
        raise ModelLoadError(f"{path.name}: {e}") from e
    return ModelConfig(
        name=path.stem,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=fields[f"{a}.feed_forward_length"],
        num_layers=fields[f"{a}.block_count"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position=fields.get(f"{a}.context_length", 4096),
        rope_theta=float(fields.get(f"{a}.rope.freq_base", 10000.0)),
        rms_eps=float(fields.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_scaling=scaling,
        family=family.name,
        **graph,
    )


def open_gguf(path: Path):
    """A ``gguf.GGUFReader`` of ``path``; a file that is not a GGUF, or is cut short, is a ModelLoadError
    naming the file and what is wrong (never a numpy reshape error)."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

    class CheckedReader(gguf.GGUFReader):
        metadata: dict[str, Any]

        def _build_fields(self, offs: int, count: int) -> int:
            """The metadata by `_read_metadata`; the reader's own fields only where it sees an unusual header
            (or a big-endian file), so such a file fails or reads as it always did."""
            try:
                if self.byte_order != "I":
                    raise _Unusual("a big-endian file")
                self.metadata, end, alignment = _read_metadata(memoryview(self.data), offs, int(count))
                if alignment is not None and alignment[0] != _UINT32:
                    raise _Unusual("general.alignment is not a uint32")  # the reader refuses it, naming it
            except (_Unusual, struct.error, UnicodeDecodeError):
                end = super()._build_fields(offs, count)
                self.metadata = _field_values(self)
                return end
            if alignment is not None:  # what the reader checks and lays the tensors out by
                self._push_field(gguf.ReaderField(offs, "general.alignment", [np.array([alignment[1]], np.uint32)],
                                                  [0], [GGUFValueType.UINT32]), skip_sum=True)
            return end

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            size = len(self.data)
            for f in fields:  # the same extent the reader computes, checked before it slices the file
                _, name, _, dims, raw_type, offset = f.parts
                qtype = GGMLQuantizationType(int(raw_type[0]))
                block, type_size = GGML_QUANT_SIZES[qtype]
                need = int(np.prod(dims)) * type_size // block
                at = int(start_offs + offset[0])
                if at + need > size:
                    raise ModelLoadError(
                        f"{path}: truncated: tensor {bytes(name).decode('utf-8', 'replace')} needs {need:,} bytes "
                        f"at offset {at:,}, the file has {size:,} bytes (re-download or re-convert it)")
            super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(str(path))
    except ModelLoadError:
        raise
    except ValueError as e:  # "GGUF magic invalid", an unsupported version, a bad field
        raise ModelLoadError(f"{path}: not a readable GGUF file: {e}") from e
    except (IndexError, OverflowError, KeyError, TypeError) as e:  # the header itself is cut short or garbled
        raise ModelLoadError(f"{path}: not a readable GGUF file: its header is truncated or corrupt "
                             f"({type(e).__name__}: {e})") from e


def gguf_text(path: Path, digest: str):
    """(ModelText, the GGUFReader if we had to parse the file, else None)."""
    meta_path = cache_file(digest, "meta", ".json", _META_FORMAT)
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        tok = TextTokenizer(Tokenizer.from_str(meta["tokenizer"]), set(meta["eos_ids"]), meta["bos_id"], meta["add_bos"])
        template = ChatTemplate(meta["chat_template"], meta["bos_token"], meta["eos_token"])
        return ModelText(ModelConfig(**meta["config"]), tok, template, meta["identity"], path, True,
                         meta["sampling"]), None

    reader = open_gguf(path)
    fields = gguf_fields(reader)
    cfg = _gguf_config(fields, path)
    odd = next((t for t in reader.tensors if t.tensor_type.name not in GGUF_TYPES), None)
    if odd is not None:
        raise ModelLoadError(f"{path.name}: tensor {odd.name} has quant type {odd.tensor_type.name} "
                             f"(supported: {', '.join(GGUF_TYPES)})")
    tensor_names = {t.name for t in reader.tensors}
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:  # llama3 scaling baked into a tensor of frequency divisors
        cfg = ModelConfig(**{**cfg.__dict__, "rope_scaling": {"rope_type": "factors",
                                                              "factors": np.asarray(rope_freqs.data).tolist()}})
    cfg = ModelConfig(**{**cfg.__dict__, "tie_embeddings": "output.weight" not in tensor_names})
    try:
        tok = TextTokenizer.from_gguf_fields(fields)
    except ValueError as e:  # engine.tokenizer cannot import ModelLoadError (it would be a cycle)
        raise ModelLoadError(f"{path.name}: {e}") from e
    tokens = fields["tokenizer.ggml.tokens"]
    bos = fields.get("tokenizer.ggml.bos_token_id")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    template = ChatTemplate(
        fields.get("tokenizer.chat_template") or families.by_name(cfg.family).chat_template or CHATML,
        bos_token=tokens[bos] if bos is not None else "",
        eos_token=tokens[eos] if eos is not None else "",
    )
    identity = f"{fields.get('general.basename') or path.stem}-{digest[:12]}"
    sampling = declared_sampling(fields, _GGUF_SAMPLING)
    meta = {
        "config": cfg.__dict__, "tokenizer": tok.tok.to_str(), "eos_ids": sorted(tok.declared_eos_ids),
        "bos_id": tok.bos_id, "add_bos": tok.add_bos, "chat_template": template.source, "bos_token": template.bos_token,
        "eos_token": template.eos_token, "identity": identity, "sampling": sampling,
    }
    write_atomic(meta_path, json.dumps(meta).encode())
    return ModelText(cfg, tok, template, identity, path, False, sampling), reader
