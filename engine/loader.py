"""Load a model of any family (`engine.families`) from a GGUF file or a Hugging Face directory.

Weights come out in the engine's own naming with QKV and gate/up fused, each linear weight dense
or quantized (`engine.quant`). `--quantization auto` keeps a GGUF's blocks as the kernels take them:
Q4_0/Q4_1 as int4 exactly; Q4_K as int4 too, its 6-bit sub-block scales and mins multiplied out and
rounded to float16 (2^-11 relative, see `_q4k_codes`); Q8_0, Q5_0 and Q4_0 as Q8_0 blocks exactly (their codes
fit int8 with the same scale); Q6_K, Q5_K and Q5_1 re-quantized to Q8_0 blocks (8 bits for their 5-6: the
rounding adds about 1/16 of their own error's variance). Float tensors and Hugging Face checkpoints stay
dense; `int8`/`int4` quantize everything, `none` dequantizes everything. Parsing a GGUF
and repacking costs seconds, so the result is cached as safetensors keyed by the file's hash, the
dtype and the quantization; a second process memory-maps the cache and starts fast.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import families, native
from engine.chat_template import ChatTemplate
from engine.config import ModelConfig
from engine.gguf_file import gguf_text, open_gguf
from engine.hf_file import hf_text
from engine.model_cache import cache_file, stat_digest
from engine.model_files import QUANTIZATIONS, resolve_model_path
from engine.model_text import ModelLoadError
from engine.progress import LoadProgress
from engine.quant import Int4Weight, Q8Weight, encode_weight, has_integer_weights
from engine.tokenizer import TextTokenizer
from kv.layout import DTYPES

log = logging.getLogger(__name__)

_FLOAT_TYPES = {"F32", "F16", "BF16"}
_INT4_TYPES = {"Q4_0", "Q4_1", "Q4_K"}  # int4 codes with a scale and offset per 32: engine.quant.Int4Weight
_Q8_TYPES = {"Q8_0", "Q5_0", "Q4_0"}  # codes that fit int8 with a float16 scale per 32: Q8Weight, exactly
_Q8_REQUANT_TYPES = {"Q6_K", "Q5_K", "Q5_1"}  # re-quantized to Q8_0 blocks (finer than theirs)


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

    @property
    def quantized(self) -> bool:
        """Whether some linear layer's weights are integer codes (int4, Q8_0, int8), read from the weights."""
        return has_integer_weights(self.weights)


def load_model(spec: str, dtype: str = "float32", quantization: str = "auto",
               progress: LoadProgress | None = None) -> LoadedModel:
    """The model's weights in the engine's layout, with its tokenizer and template; ``progress`` hears each
    phase (parse, repack layer by layer, cache) — quiet by default."""
    progress = progress or LoadProgress("load", quiet=True)
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unsupported quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    try:
        native.kernel_path()  # a TANDEM_KERNELS this CPU lacks fails here, not at the first step
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    path = resolve_model_path(spec)
    t0 = time.perf_counter()
    if path.is_dir():
        progress.phase(f"reading {path}")
        loaded = _load_hf(path, dtype, quantization)
    else:
        loaded = _load_gguf(path, dtype, quantization, progress)
    loaded.load_seconds = time.perf_counter() - t0
    progress.done(f"model loaded ({dtype}, weights {loaded.quantization})")
    log.info("loaded %s (%s, weights %s) in %.2fs%s", path, dtype, loaded.quantization, loaded.load_seconds,
             " from cache" if loaded.from_cache else "")
    return loaded


# ---------------------------------------------------------------- GGUF


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> half-split)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, dtype: str, quantization: str, progress: LoadProgress) -> LoadedModel:
    progress.phase(f"reading {path}")
    digest = stat_digest(path)
    text, reader = gguf_text(path, digest)
    weights_path = cache_file(digest, f"{dtype}-{quantization}-torch{torch.__version__.split('+')[0]}", ".safetensors")
    from_cache = weights_path.exists()
    if from_cache:  # memory-mapped: no dequantization
        progress.phase(f"weights from the cache {weights_path}")
        with safe_open(str(weights_path), framework="pt") as f:
            label = (f.metadata() or {}).get("quantization", quantization)
        weights = load_file(str(weights_path))
    else:
        if reader is None:
            reader = open_gguf(path)
        progress.phase(f"repacking the weights ({quantization}) layer by layer", total=text.config.num_layers)
        weights, label = _gguf_weights(path, {t.name: t for t in reader.tensors}, text.config, dtype, quantization,
                                       progress.step)
        progress.phase(f"caching them at {weights_path} (the next start reads them from there)")
        _save_cache(weights, weights_path, {"quantization": label})
    return LoadedModel(text.config, weights, text.tokenizer, text.chat_template, text.identity, path, 0.0,
                       from_cache, label)


class GGUFWeights:
    """Turns a GGUF file's tensors into the engine's weights, each in the kind `mode` asks for."""

    def __init__(self, source: str, tensors: dict, mode: str, dtype: str):
        self.source, self.tensors, self.mode, self.dtype = source, tensors, mode, DTYPES[dtype]
        self.kinds: set[str] = set()  # what the weights encoded so far became

    def check(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.source}: tensor {name} is missing (an incomplete GGUF, or one whose "
                                 "general.architecture does not say what it holds)")
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
            kind = "q8_0" if self.mode == "auto" and shape[1] % 32 == 0 else "int8"
            log.info("%s: %s is %dx%d, which the int4 kernel cannot take; using %s", self.source, parts[0][0],
                     *shape, kind)
        self.kinds.add(kind)
        if kind == "int4" and types <= _INT4_TYPES:  # the file's own codes, scales and offsets
            codes = [_q4_codes(self.tensors[name], heads) for name, heads in parts]
            return Int4Weight.from_codes(*(torch.cat(c) for c in zip(*codes))).tensors(prefix)
        if kind == "q8_0":  # the file's own codes where they fit int8, re-quantized otherwise
            blocks = [_q8_codes(self.tensors[name], heads) if self.tensors[name].tensor_type.name in _Q8_TYPES
                      else Q8Weight.quantize(self.floats(name, heads)).blocks() for name, heads in parts]
            return Q8Weight(*(torch.cat(c) for c in zip(*blocks))).tensors(prefix)
        w = torch.cat([self.floats(name, heads) for name, heads in parts])
        return encode_weight(w, kind, prefix, self.dtype)


#: GGUF per-layer norm tensors -> the engine's names; the second group only where the config says
_GGUF_NORMS = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm"}
_GGUF_SANDWICH = {"post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_ffn_norm"}
_GGUF_QK_NORMS = {"attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}


def _gguf_weights(path: Path, tensors: dict, cfg: ModelConfig, dtype: str, mode: str,
                  layer_done: Callable[[], None] = lambda: None) -> tuple[dict[str, torch.Tensor], str]:
    """The engine's weights from GGUF tensors, and the label of what they became."""
    g = GGUFWeights(str(path), tensors, mode, dtype)
    permuted = families.by_name(cfg.family).gguf_permuted_qk
    qh, kh = (cfg.num_heads, cfg.num_kv_heads) if permuted else (0, 0)
    out: dict[str, torch.Tensor] = {"norm": g.floats("output_norm.weight").to(g.dtype)}
    out.update(g.weight("embed", [("token_embd.weight", 0)], embedding=True))
    if "output.weight" in tensors:
        out.update(g.weight("lm_head", [("output.weight", 0)], embedding=True))
    norms = {**_GGUF_NORMS, **(_GGUF_SANDWICH if cfg.sandwich_norms else {}), **(_GGUF_QK_NORMS if cfg.qk_norm else {})}
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        layer = {
            "wqkv": [(p + "attn_q.weight", qh), (p + "attn_k.weight", kh), (p + "attn_v.weight", 0)],
            "wo": [(p + "attn_output.weight", 0)],
            "w_gate_up": [(p + "ffn_gate.weight", 0), (p + "ffn_up.weight", 0)],
            "w_down": [(p + "ffn_down.weight", 0)],
        }
        for theirs, ours in norms.items():
            out[f"layers.{i}.{ours}"] = g.floats(f"{p}{theirs}.weight").to(g.dtype)
        if cfg.qkv_bias:
            out[f"layers.{i}.wqkv_bias"] = torch.cat([g.floats(p + "attn_q.bias", qh), g.floats(p + "attn_k.bias", kh),
                                                      g.floats(p + "attn_v.bias")]).to(g.dtype)
        for name, parts in layer.items():
            out.update(g.weight(f"layers.{i}.{name}", parts))
        layer_done()
    return out, _label(mode, g.kinds)


def _weight_kind(mode: str, types: set[str], embedding: bool) -> str:
    """The kind (none, fp16, int8, int4, q8_0) of one weight whose GGUF tensors have `types`."""
    if mode in ("none", "fp16", "int8"):
        return mode
    if mode == "int4":  # the embedding/LM head stays int8 unless it already is int4
        return "int4" if not embedding or types <= _INT4_TYPES else "int8"
    if types <= _FLOAT_TYPES:
        return "none"
    return "int4" if types <= _INT4_TYPES else "q8_0"


def _label(mode: str, kinds: set[str]) -> str:
    return f"auto:{'+'.join(sorted(kinds))}" if mode == "auto" else mode


def _int4_fits(shape: tuple[int, int]) -> bool:
    n, k = shape
    return n % 32 == 0 and k % 64 == 0


def _blocks(t, block_bytes: int) -> np.ndarray:
    """A quantized tensor's raw blocks [rows, blocks per row, block_bytes]."""
    n = int(t.shape[1])
    return np.asarray(t.data).reshape(n, -1, block_bytes)


def _q4_codes(t, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1/Q4_K tensor's codes [N, K] (0..15) and per-32 d and m [N, K/32] (float16), ``w = d q + m``:
    Q4_1: q * d + m; Q4_0: (q - 8) * d, so m = -8 d (both exactly); Q4_K: d * sc * q - dmin * mn per 32, with
    d * sc and dmin * mn (a float16 times a 6-bit integer) rounded to float16."""
    n, k = int(t.shape[1]), int(t.shape[0])
    kind = t.tensor_type.name
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        raw = _blocks(t, 144)
        d, dmin = (raw[..., a:a + 2].copy().view(np.float16)[..., 0].astype(np.float32)[..., None] for a in (0, 2))
        sc, mn = Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12))
        sc, mn = sc.reshape(n, -1, 8), mn.reshape(n, -1, 8)
        qs = raw[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 0xF).reshape(n, k)  # sub-block 2c: the low nibbles of 32 bytes, 2c + 1: their high nibbles
        d = (d * sc).astype(np.float16).reshape(n, k // 32)
        m = (-(dmin * mn)).astype(np.float16).reshape(n, k // 32)
    else:
        offset = 4 if kind == "Q4_1" else 2
        raw = _blocks(t, offset + 16)
        d = raw[..., 0:2].copy().view(np.float16)[..., 0]
        qs = raw[..., offset:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k)  # element j low nibble, j + 16 high
        m = raw[..., 2:4].copy().view(np.float16)[..., 0] if offset == 4 else d * np.float16(-8)
    if heads:
        q, d, m = (_unpermute(a, heads) for a in (q, d, m))
    return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(d)), \
        torch.from_numpy(np.ascontiguousarray(m))


def _q8_codes(t, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0, Q5_0 or Q4_0 tensor's int8 codes [N, K] and float16 scales [N, K/32] (as int16 bits), exactly its
    blocks (Q5_0: q - 16 with q's fifth bit from qh; Q4_0: q - 8)."""
    n, k = int(t.shape[1]), int(t.shape[0])
    kind = t.tensor_type.name
    raw = _blocks(t, {"Q8_0": 34, "Q5_0": 22, "Q4_0": 18}[kind])
    scales = raw[..., 0:2].copy().view(np.int16)[..., 0]
    if kind == "Q8_0":
        q = raw[..., 2:].copy().view(np.int8).reshape(n, k)
    else:
        qs = raw[..., -16:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # element j: low nibble of byte j, j + 16: high nibble
        if kind == "Q5_0":
            qh = raw[..., 2:6].copy().view(np.uint32)  # bit j: element j's fifth bit
            q = q | (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
        q = (q.astype(np.int16) - (16 if kind == "Q5_0" else 8)).astype(np.int8).reshape(n, k)
    if heads:
        q, scales = _unpermute(q, heads), _unpermute(scales, heads)
    return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(scales))


def _save_cache(weights: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


#: per-layer norms in the engine's naming (those past the first two only in some families)
LAYER_NORMS = ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm")


def _required(cfg: ModelConfig) -> list[str]:
    """The per-layer tensors (engine names, before fusing) a model of `cfg` must have."""
    names = ["attn_norm", "ffn_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]
    names += ["post_attn_norm", "post_ffn_norm"] if cfg.sandwich_norms else []
    names += ["q_norm", "k_norm"] if cfg.qk_norm else []
    return names + (["bq", "bk", "bv"] if cfg.qkv_bias else [])


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
        for norm in LAYER_NORMS:
            if p + norm in raw:
                out[p + norm] = raw[p + norm].to(dtype)
        if p + "bq" in raw:
            out[p + "wqkv_bias"] = torch.cat([raw[p + "bq"], raw[p + "bk"], raw[p + "bv"]]).to(dtype)
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


def _load_hf(path: Path, dtype: str, quantization: str) -> LoadedModel:
    text = hf_text(path)
    cfg = text.config
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    family = families.by_name(cfg.family)
    names, offset = family.hf_layer_names, family.hf_norm_offset
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
                    if rest in names:
                        raw[f"layers.{idx}.{names[rest]}"] = t
                    elif not rest.endswith("rotary_emb.inv_freq"):
                        raise ModelLoadError(f"{f.name}: unexpected tensor {key} for a {family.name} model")
    if offset:  # the family's norms scale by (offset + w)
        raw = {k: v.float() + offset if k == "norm" or k.endswith("_norm") else v for k, v in raw.items()}
    missing = [f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in _required(cfg)
               if f"layers.{i}.{n}" not in raw]
    if missing:
        raise ModelLoadError(f"{path}: tensors missing for a {family.name} model: {', '.join(missing[:4])}"
                             + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    if "lm_head" not in raw and not cfg.tie_embeddings:
        raise ModelLoadError(f"{path}: lm_head.weight missing and tie_word_embeddings is false")
    weights = fuse_weights(raw, cfg, DTYPES[dtype], quantization)  # auto: float checkpoints stay dense
    return LoadedModel(cfg, weights, text.tokenizer, text.chat_template, text.identity, path, 0.0, False,
                       _label(quantization, {"none"}))
