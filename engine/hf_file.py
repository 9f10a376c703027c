"""A Hugging Face model directory without its weights: config.json, the tokenizer, the chat template and sampling
defaults, and an identity from sampled weight bytes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine import families
from engine.chat_template import CHATML, ChatTemplate
from engine.config import ROPE_SCALING_KEYS, ModelConfig, rope_scaling_type
from engine.model_text import ModelLoadError, ModelText, declared_sampling
from engine.tokenizer import TextTokenizer

_SAMPLE = 1 << 16  # bytes hashed at the start, middle and end of each safetensors file
_TENSOR_SAMPLE = 1 << 12  # bytes hashed from the middle of each tensor
#: sampling defaults a model may declare: generation_config.json key -> SamplingParams field
_HF_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                "repetition_penalty": "repetition_penalty"}


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
                sampling = declared_sampling(declared, _HF_SAMPLING)
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
