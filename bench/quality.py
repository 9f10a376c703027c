"""What a weight format costs in quality: perplexity on a fixed text and greedy agreement with float32.

    python -m bench.quality [--quantization fp16,int8,int4,auto] [--write]

The text is tests/data/perplexity.txt (original prose shipped with the tests), scored in windows of
1,024 tokens, twice: each window as one prompt (the prefill path: `native.kernel_path()`'s long-chunk
matmul, bfloat16 panels on avx512_bf16, dequantized weights and MKL elsewhere; `--kernels` scores each) and as
chunks of `small_rows()` tokens (every row on the quantized kernels with int16 activations, two int8 digits on
avx512_vnni, as decode batches below `native.panel_min_rows` are); greedy agreement is the share of a fixed set of chat prompts
whose first 16 greedy tokens equal those of `--quantization none` (float32 of the dequantized weights),
decoded in batches of `small_rows()` and all in one batch (where int4 layers take the float32 panels, but on
avx512_vnni the same kernels as any batch); and of
20 passages of the text, LONG_PROMPT tokens each, read alone as one chunk (on the long-chunk matmul: int8
activations on avx512_vnni), how many continue with the same 16 greedy tokens.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import native
from engine.engine import EngineConfig, LLMEngine
from engine.linear_paths import KERNELS
from engine.loader import LoadedModel, load_model
from engine.model_files import DEFAULT_MODEL, model_name
from engine.params import SamplingParams

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity.txt"
WINDOW = 1024
GREEDY_TOKENS = 16
LONG_PROMPT = 300  # tokens of a passage: one chunk past KERNELS.kernel_max_chunk, so on the long-chunk matmul
LONG_PROMPTS = 20
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "Who wrote Hamlet?", "What is 12 times 7?", "Give me a recipe for pancakes.",
    "Translate 'good morning' to Spanish.", "What is a black hole?", "Describe a cat.", "How do airplanes fly?",
    "What is the boiling point of water?", "Name a famous painter.", "Why is the sky blue?", "Tell me a joke.",
    "What does a bicycle chain do?", "Summarize the plot of Cinderella.", "What is rain made of?",
    "How many legs does a spider have?", "What is the largest ocean?",
]


@dataclass
class Quality:
    label: str
    perplexity: float  # windows as whole prompts
    kernel_perplexity: float  # windows in chunks that run on the kernels with int16 activations
    greedy: list[list[int]]  # all prompts decoded in one batch
    greedy_small: list[list[int]]  # in batches of small_rows()
    greedy_long: list[list[int]]  # the continuations of LONG_PROMPTS passages of the text, each alone


def small_rows() -> int:
    """Rows a step may have and still run every quantized matmul on int16 activations."""
    if not native.available():
        return KERNELS.kernel_max_chunk
    return min(8, native.panel_min_rows("int4") - 1, native.panel_min_rows("q8_0") - 1)


def score(loaded: LoadedModel, text: str = "") -> Quality:
    """Perplexity of the text (mean over its windows' next-token log-likelihoods, per path) and greedy outputs."""
    engine = _engine(loaded)
    windows = _windows(loaded, text)
    perplexities = [_perplexity(engine, windows, chunk) for chunk in (WINDOW, small_rows())]
    prompts = [loaded.tokenizer.encode_prompt(loaded.chat_template.render([{"role": "user", "content": p}]))
               for p in PROMPTS]
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    together = [s.output_ids for s in engine.generate(prompts, params)]
    n = small_rows()
    apart = [s.output_ids for i in range(0, len(prompts), n) for s in engine.generate(prompts[i:i + n], params)]
    long = [engine.generate([p], params)[0].output_ids for p in _passages(loaded, text)]
    return Quality(loaded.quantization, *perplexities, together, apart, long)


def perplexity(loaded: LoadedModel, text: str = "", chunk: int = WINDOW) -> float:
    """The text's perplexity alone, its windows computed `chunk` tokens a forward pass (`score` does both paths)."""
    return _perplexity(_engine(loaded), _windows(loaded, text), chunk)


def _engine(loaded: LoadedModel) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_blocks=WINDOW // 16 + 8, max_step_tokens=WINDOW, max_batch=len(PROMPTS),
                                          enable_prefix_cache=False))


def _windows(loaded: LoadedModel, text: str) -> list[list[int]]:
    """The text's tokens in windows of WINDOW, each read as a prompt (BOS first where the model wants one:
    Gemma is lost without it)."""
    tok = loaded.tokenizer
    ids = tok.encode(text or TEXT.read_text())
    bos = [tok.bos_id] if tok.add_bos else []
    step = WINDOW - len(bos)
    return [bos + ids[s:s + step] for s in range(0, len(ids) - 1, step) if len(ids[s:s + step]) >= 2]


def _passages(loaded: LoadedModel, text: str) -> list[list[int]]:
    """LONG_PROMPTS passages of LONG_PROMPT tokens, evenly spread over the text (BOS first where the model wants
    one)."""
    tok = loaded.tokenizer
    ids = tok.encode(text or TEXT.read_text())
    bos = [tok.bos_id] if tok.add_bos else []
    step = max(1, (len(ids) - LONG_PROMPT) // LONG_PROMPTS)
    return [bos + ids[s:s + LONG_PROMPT] for s in range(0, len(ids) - LONG_PROMPT, step)][:LONG_PROMPTS]


def _perplexity(engine: LLMEngine, windows: list[list[int]], chunk: int) -> float:
    """Each window's tokens scored with a forward pass per `chunk` tokens (the window's earlier KV cached)."""
    nll, count = 0.0, 0
    for window in windows:
        logits = engine.prompt_logits(window, list(range(chunk, len(window), chunk)))
        logp = torch.log_softmax(logits[:-1], dim=-1)
        nll -= logp.gather(1, torch.tensor(window[1:]).unsqueeze(1)).sum().item()
        count += len(window) - 1
    return math.exp(nll / count)


def agreement(a: Quality, b: Quality, small: bool = False, long: bool = False) -> int:
    """Prompts whose first greedy tokens are the same under both (chat prompts decoded in one batch, or in
    `small` ones; or the `long` passages)."""
    pairs = zip(a.greedy_long, b.greedy_long) if long else \
        zip(a.greedy_small, b.greedy_small) if small else zip(a.greedy, b.greedy)
    return sum(x == y for x, y in pairs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantization", default="fp16,int8,int4,auto", help="formats to compare with none")
    p.add_argument("--kernels", default="",
                   help="kernel paths to score each format on, e.g. avx512_bf16,avx2 (default: the best here)")
    p.add_argument("--write", action="store_true", help="update the section in docs/benchmarks.md")
    args = p.parse_args(argv)
    ref = score(load_model(args.model, "float32", "none"))
    lines = [
        "## Engine: quality of the weight formats" + ("" if args.model == DEFAULT_MODEL else f" ({args.model})"),
        "",
        f"`python -m bench.quality` on {args.model}: perplexity of tests/data/perplexity.txt "
        f"(windows of {WINDOW} tokens, each as one prompt, its rows on the kernel path's long-chunk matmul, "
        f"then in chunks of {small_rows()} that run on the "
        f"quantized kernels with int16 activations, two int8 digits on avx512_vnni, as small decode batches do) "
        f"and how many of {len(PROMPTS)} "
        f"chat prompts give the same first {GREEDY_TOKENS} greedy tokens as `none` (float32 of the dequantized "
        f"weights), decoded in batches of {small_rows()} / all {len(PROMPTS)} in one batch (float32 panels; on "
        f"avx512_vnni its kernels again); and of "
        f"{len(ref.greedy_long)} passages of the text, {LONG_PROMPT} tokens each read alone as one prompt (on the "
        f"long-chunk matmul), how many continue with the same {GREEDY_TOKENS} greedy tokens as under `none`.",
        "",
        "| quantization | weights, kernel path | perplexity | vs none | perplexity, kernels | vs none "
        "| greedy 16 tokens equal | after a passage |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        f"| none | none | {ref.perplexity:.3f} | 1.000 | {ref.kernel_perplexity:.3f} | 1.000 | "
        f"{len(PROMPTS)}/{len(PROMPTS)} | {len(ref.greedy_long)}/{len(ref.greedy_long)} |",
    ]
    paths = [k for k in args.kernels.split(",") if k] or [native.kernel_path()]
    for mode in args.quantization.split(","):
        loaded = load_model(args.model, "float32", mode)
        for path in paths:
            if path in native.KERNEL_PATHS:
                native.use_kernel_path(path)
            q = score(loaded)
            lines.append(f"| {mode} | {q.label}, {path} | {q.perplexity:.3f} | {q.perplexity / ref.perplexity:.4f} | "
                         f"{q.kernel_perplexity:.3f} | {q.kernel_perplexity / ref.kernel_perplexity:.4f} | "
                         f"{agreement(q, ref, small=True)}/{len(PROMPTS)} / {agreement(q, ref)}/{len(PROMPTS)} | "
                         f"{agreement(q, ref, long=True)}/{len(q.greedy_long)} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.write:
        from bench.report import write_section

        write_section("engine-quality" if args.model == DEFAULT_MODEL else f"engine-quality-{model_name(args.model)}",
                      report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
