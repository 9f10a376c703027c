"""Speculative decoding (prompt lookup) on and off, side by side in one run.

    python -m bench.speculation [--batches 1,2,4,8] [--max-tokens 128] [--rounds 3] [--threads N]
                                [--quantization auto] [--model M]

Two engines over the same loaded weights, one with `speculative="ngram"` and one with it off, take turns a
batch each, `--rounds` times after a warm-up. Workloads: "copy" (chats asking for a given text back with a
small edit: what prompt lookup is for), "chat" (bench.quality's chat prompts) and "schema" (a JSON schema
with long keys: grammar fast-forward). Output tok/s is every generated token over the batch's wall time,
greedy; the table gives medians, the on/off ratio, the share of draft tokens kept, and whether both engines
wrote the same tokens. First it times a step of one decoding row with 0-8 draft rows, which gives a step's
fixed cost in rows (`SpeculationConfig.step_rows`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import msgspec
import torch

from bench.quality import PROMPTS
from engine.engine import EngineConfig, LLMEngine
from engine.loader import LoadedModel, load_model
from engine.model_files import DEFAULT_MODEL
from engine.params import Grammar, SamplingParams
from engine.speculation import SpeculationConfig, StepCost

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


SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["customer_full_name", "shipping_address_first_line", "preferred_delivery_weekday",
                       "gift_wrapping_requested"],
          "properties": {"customer_full_name": {"type": "string", "maxLength": 24},
                         "shipping_address_first_line": {"type": "string", "maxLength": 32},
                         "preferred_delivery_weekday": {"enum": ["Monday", "Wednesday", "Friday"]},
                         "gift_wrapping_requested": {"type": "boolean"}}}
ORDERS = ["Ann Lee lives at 4 Elm Road and wants Friday deliveries, no gift wrap.",
          "Bo Chen, 12 Harbour Street, Mondays please, and wrap it as a gift.",
          "Carla Diaz of 9 Mill Lane asks for Wednesday delivery with gift wrapping.",
          "Dev Patel, 31 Station Road, Friday, plain packaging."]


def _ids(loaded: LoadedModel, messages: list[str]) -> list[list[int]]:
    return [loaded.tokenizer.encode_prompt(loaded.chat_template.render([{"role": "user", "content": m}]))
            for m in messages]


def _timed(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    seqs = engine.generate(prompts, params)
    dt = time.perf_counter() - t
    return sum(len(s.output_ids) for s in seqs) / dt, [s.output_ids for s in seqs]


def step_rows(engine: LLMEngine, drafts: tuple[int, ...] = (0, 1, 2, 4, 8), repeats: int = 15) -> float:
    """A step's fixed cost in rows (F / r of t(k) = F + r (1 + k), fitted to steps of one row and k draft rows)."""
    seq = engine.add_request("rows", list(range(100, 300)), SamplingParams(max_tokens=400, ignore_eos=True))
    while not seq.output_ids:
        engine.step()
    times = []
    for k in drafts:
        samples = []
        for _ in range(repeats):
            seq.draft = [seq.output_ids[-1]] * k
            engine.scheduler._room_for_draft(seq)
            t = time.perf_counter()
            engine.runner.run([(seq, 1 + k)], {})
            samples.append(time.perf_counter() - t)
            seq.draft = []
        times.append(statistics.median(samples))
    engine.abort("rows")
    cost = StepCost(engine.drafter.cfg.step_rows if engine.drafter else SpeculationConfig().step_rows)
    for k, t in zip(drafts, times):  # the engine's own fit, to the medians
        cost.observe(1 + k, t)
    print("step of 1 + k rows: " + ", ".join(f"k={k} {t * 1e3:.1f} ms" for k, t in zip(drafts, times))
          + f"; F/r = {cost.step_rows():.2f} rows", flush=True)
    return cost.step_rows()


def run(model: str, quantization: str, batches: list[int], max_tokens: int, rounds: int) -> list[dict]:
    loaded = load_model(model, "float32", quantization=quantization)
    on = LLMEngine(loaded, EngineConfig(num_blocks=512, speculative="ngram"))
    off = LLMEngine(loaded, EngineConfig(num_blocks=512, speculative="off"))
    step_rows(off)
    print("| workload | batch | on tok/s | off tok/s | on/off | drafts kept | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    grammar = Grammar(kind="json_schema", value=json.dumps(SCHEMA))
    workloads = {"copy": (_ids(loaded, copy_prompts()), SamplingParams(max_tokens=max_tokens, temperature=0.0)),
                 "chat": (_ids(loaded, PROMPTS), SamplingParams(max_tokens=max_tokens, temperature=0.0)),
                 "schema": (_ids(loaded, [f"Give this order as JSON: {o}" for o in ORDERS]),
                            SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar))}
    rows = []
    for name, (pool, params) in workloads.items():
        for b in batches:
            prompts = [pool[i % len(pool)] for i in range(b)]
            warm = msgspec.structs.replace(params, max_tokens=8)
            _timed(on, prompts, warm), _timed(off, prompts, warm)
            speeds: dict[str, list[float]] = {"on": [], "off": []}
            same = True
            drafted, accepted = on.drafter.drafted, on.drafter.accepted
            for _ in range(rounds):
                a, out_on = _timed(on, prompts, params)
                c, out_off = _timed(off, prompts, params)
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
    run(a.model, a.quantization, [int(x) for x in a.batches.split(",")], a.max_tokens, a.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
