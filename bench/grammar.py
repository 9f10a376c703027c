"""Per-token cost of a structured-output token mask: llguidance against xgrammar, side by side.

For each JSON schema, a schema-valid answer is tokenized with the served model's tokenizer; each
library then walks it token by token (mask for the next token, then accept the token), and the
median mask and accept times per token are reported, after one warm-up pass. Grammar compilation
is timed apart. Usage::

    python -m bench.grammar [--model smollm2-135m-instruct] [--rounds 5] [--json out.json]

A library that is not installed is reported as missing (xgrammar is not a tandem dependency:
``pip install --no-deps xgrammar apache-tvm-ffi`` to compare).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": (
        {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name", "age"]},
        {"name": "Ada Lovelace", "age": 36},
    ),
    "nested": (
        {"type": "object", "properties": {
            "city": {"type": "string"},
            "population": {"type": "integer"},
            "landmarks": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "year": {"type": "integer"}}, "required": ["name", "year"]}},
            "capital": {"type": "boolean"},
        }, "required": ["city", "population", "landmarks", "capital"]},
        {"city": "Paris", "population": 2102650, "landmarks": [{"name": "Eiffel Tower", "year": 1889},
                                                               {"name": "Notre-Dame", "year": 1345}],
         "capital": True},
    ),
    "enum": (
        {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                          "confidence": {"type": "number"}},
         "required": ["answer", "confidence"]},
        {"answer": "maybe", "confidence": 0.5},
    ),
}


def _walk(mask: Callable[[], None], accept: Callable[[int], None], ids: list[int]) -> tuple[list[float], list[float]]:
    masks, accepts = [], []
    for t in ids:
        t0 = time.perf_counter()
        mask()
        t1 = time.perf_counter()
        accept(t)
        masks.append(t1 - t0)
        accepts.append(time.perf_counter() - t1)
    return masks, accepts


def bench_llguidance(tok_json: str, vocab: int, eos: list[int], schema: dict, ids: list[int], rounds: int
                     ) -> dict[str, float]:
    import llguidance
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    tok_s = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    bitmask = lt.allocate_token_bitmask(1, vocab)
    out: dict[str, list[float]] = {"mask": [], "accept": [], "compile": []}
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - t0
        if m.is_error():
            raise RuntimeError(m.get_error())

        def accept(t: int, m: Any = m) -> None:
            if not m.consume_token(t):
                raise RuntimeError(f"llguidance refused token {t}: {m.get_error()}")

        masks, accepts = _walk(lambda m=m: lt.fill_next_token_bitmask(m, bitmask), accept, ids)
        if r:  # the first round warms up
            out["mask"] += masks
            out["accept"] += accepts
            out["compile"].append(compile_s)
    return {"tokenizer_s": tok_s, **{k: statistics.median(v) for k, v in out.items()}}


def bench_xgrammar(vocab_list: list[str], vocab: int, eos: list[int], schema: dict, ids: list[int],
                   rounds: int) -> dict[str, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab_list, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tok_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    out: dict[str, list[float]] = {"mask": [], "accept": [], "compile": []}
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        m = xgr.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - t0

        def accept(t: int, m: Any = m) -> None:
            if not m.accept_token(t):
                raise RuntimeError(f"xgrammar refused token {t}")

        masks, accepts = _walk(lambda m=m: m.fill_next_token_bitmask(bitmask), accept, ids)
        if r:
            out["mask"] += masks
            out["accept"] += accepts
            out["compile"].append(compile_s)
    return {"tokenizer_s": tok_s, **{k: statistics.median(v) for k, v in out.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grammar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model whose tokenizer is used (default %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="timed walks per schema after one warm-up (default %(default)s)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from engine.model_files import load_text

    text = load_text(args.model)
    tok = text.tokenizer
    tok_json = tok.tok.to_str()
    vocab = text.config.vocab_size
    vocab_list = [tok.id_to_token(i) or "" for i in range(vocab)]
    eos = sorted(tok.eog_ids)
    results: dict[str, dict[str, Any]] = {}
    for name, (schema, answer) in SCHEMAS.items():
        ids = tok.encode(json.dumps(answer, separators=(",", ":")))
        row: dict[str, Any] = {"tokens": len(ids)}
        runs: dict[str, Callable[[], dict[str, float]]] = {
            "llguidance": lambda s=schema, i=ids: bench_llguidance(tok_json, vocab, eos, s, i, args.rounds),
            "xgrammar": lambda s=schema, i=ids: bench_xgrammar(vocab_list, vocab, eos, s, i, args.rounds),
        }
        for lib, run in runs.items():
            try:
                row[lib] = run()
            except ImportError as e:
                row[lib] = {"missing": str(e)}
        results[name] = row
    print(f"{'schema':<8} {'tokens':>6}  {'library':<11} {'mask µs':>9} {'accept µs':>9} {'compile ms':>10}")
    for name, row in results.items():
        for lib in ("llguidance", "xgrammar"):
            r = row[lib]
            if "missing" in r:
                print(f"{name:<8} {row['tokens']:>6}  {lib:<11} not installed")
                continue
            print(f"{name:<8} {row['tokens']:>6}  {lib:<11} {r['mask'] * 1e6:>9.1f} {r['accept'] * 1e6:>9.1f} "
                  f"{r['compile'] * 1e3:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
