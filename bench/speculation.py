"""Speculative decoding (prompt lookup) on and off, side by side in one run.

    python -m bench.speculation [--batches 1,2,4,8] [--max-tokens 128] [--rounds 3] [--threads N]
                                [--quantization auto] [--model M]

Two engines over the same loaded weights, one with `speculative="ngram"` (and its batch limit lifted, so
every batch size is measured) and one with it off, take turns a batch each, `--rounds` times after a warm-up.
Workloads: "copy" (chats asking for a given text back with a small edit: what prompt lookup is for) and
"chat" (bench.quality's chat prompts). Output tok/s is every generated token over the batch's wall time,
greedy; the table gives medians, the on/off ratio, the share of draft tokens kept, and whether both engines
wrote the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.quality import PROMPTS
from engine.engine import EngineConfig, LLMEngine
from engine.loader import LoadedModel, load_model
from engine.model_files import DEFAULT_MODEL
from engine.params import SamplingParams

PASSAGES = [
    "The library opens at nine in the morning and closes at six in the evening. Children under twelve must be "
    "accompanied by an adult. Books may be borrowed for three weeks and renewed twice online.",
    "To make the sauce, melt the butter in a small pan, stir in the flour and cook for one minute. Add the milk "
    "slowly, whisking all the time, until the sauce is smooth and thick. Season with salt and pepper.",
    "Our team meets every Tuesday at ten. Please send your weekly update to the shared folder before the meeting "
    "and bring one question for the group. The meeting ends at eleven sharp.",
    "The train to the coast leaves from platform four every hour. Tickets can be bought at the station or on the "
    "train. Bicycles travel free outside the morning rush.",
]
EDITS = [("nine", "ten"), ("butter", "oil"), ("Tuesday", "Thursday"), ("four", "two")]


def copy_prompts() -> list[str]:
    return [f"Repeat the following text exactly, but change \"{a}\" to \"{b}\":\n\n{text}"
            for text, (a, b) in zip(PASSAGES, EDITS)]


def _ids(loaded: LoadedModel, messages: list[str]) -> list[list[int]]:
    return [loaded.tokenizer.encode_prompt(loaded.chat_template.render([{"role": "user", "content": m}]))
            for m in messages]


def _timed(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t = time.perf_counter()
    seqs = engine.generate(prompts, params)
    dt = time.perf_counter() - t
    return sum(len(s.output_ids) for s in seqs) / dt, [s.output_ids for s in seqs]


def run(model: str, quantization: str, batches: list[int], max_tokens: int, rounds: int) -> list[dict]:
    loaded = load_model(model, "float32", quantization=quantization)
    on = LLMEngine(loaded, EngineConfig(num_blocks=512, speculative="ngram"))
    on.drafter.cfg.max_batch = max(batches)
    off = LLMEngine(loaded, EngineConfig(num_blocks=512, speculative="off"))
    workloads = {"copy": _ids(loaded, copy_prompts()), "chat": _ids(loaded, PROMPTS)}
    rows = []
    for name, pool in workloads.items():
        for b in batches:
            prompts = [pool[i % len(pool)] for i in range(b)]
            _timed(on, prompts, 8), _timed(off, prompts, 8)  # warm-up
            speeds: dict[str, list[float]] = {"on": [], "off": []}
            same = True
            drafted, accepted = on.drafter.drafted, on.drafter.accepted
            for _ in range(rounds):
                a, out_on = _timed(on, prompts, max_tokens)
                c, out_off = _timed(off, prompts, max_tokens)
                speeds["on"].append(a)
                speeds["off"].append(c)
                same = same and out_on == out_off
            on_s, off_s = statistics.median(speeds["on"]), statistics.median(speeds["off"])
            kept = (on.drafter.accepted - accepted) / max(1, on.drafter.drafted - drafted)
            rows.append(dict(workload=name, batch=b, on=on_s, off=off_s, ratio=on_s / off_s, kept=kept, same=same))
            print(f"| {name} | {b} | {on_s:.1f} | {off_s:.1f} | {on_s / off_s:.2f}x | {kept:.0%} | "
                  f"{'yes' if same else 'no'} |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch threads {torch.get_num_threads()}, {a.quantization}, {a.max_tokens} tokens, greedy")
    print("| workload | batch | on tok/s | off tok/s | on/off | drafts kept | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    run(a.model, a.quantization, [int(x) for x in a.batches.split(",")], a.max_tokens, a.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
