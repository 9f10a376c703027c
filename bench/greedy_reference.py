"""llama.cpp's greedy continuations of fixed prompts, recorded for the tests that hold a family to llama.cpp.

    python -m bench.greedy_reference --model gemma3-270m --out tests/data/gemma3_greedy.json

Starts `llama-server` (bench/llama_server.py finds it) on the model's GGUF, tokenizes each of bench.quality's
prompts as a completion (with the BOS the file asks for), and records its first 16 greedy tokens with the
log-probability gap between the first and second choice at each step (a gap near 0 is a tie that any other
rounding may break the other way). The file also names the GGUF's sha256, so a test knows it holds the same
weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import llama_server
from bench.quality import GREEDY_TOKENS, PROMPTS
from engine.model_cache import file_digest
from engine.model_files import resolve_model_path


def record(server: llama_server.LlamaServer, prompt: str) -> dict:
    ids = server.http.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
    body = {"prompt": ids, "n_predict": GREEDY_TOKENS, "temperature": 0.0, "cache_prompt": False, "n_probs": 2,
            "ignore_eos": True, "return_tokens": True}
    r = server.http.post("/completion", json=body).json()
    gaps = [p["top_logprobs"][0]["logprob"] - p["top_logprobs"][1]["logprob"] for p in r["completion_probabilities"]]
    return {"prompt": prompt, "prompt_ids": ids, "ids": r["tokens"], "gaps": gaps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.greedy_reference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    binary = llama_server.find()
    if binary is None:
        raise SystemExit("llama-server not found: set TANDEM_LLAMA_SERVER (DESIGN §8 says how to build it)")
    path = resolve_model_path(args.model)
    server = llama_server.LlamaServer(binary, path, threads=2, slots=1, ctx=2048)
    try:
        server.wait_ready()
        cases = [record(server, prompt) for prompt in PROMPTS]
    finally:
        server.stop()
    Path(args.out).write_text(json.dumps({"gguf_sha256": file_digest(path), "cases": cases}, indent=1) + "\n")
    print(f"wrote {len(cases)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
