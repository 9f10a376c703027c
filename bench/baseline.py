"""An earlier commit's engine as a column of bench.engine, measured in the same run.

Issue targets are stated against the engine as it was ("batch 32 >= 2x today's float32"), and absolute
speeds on these shared machines move 2x from day to day; so the old engine is measured again, side by side,
instead of quoting its figure. `Baseline(rev)` extracts `rev` of this repository (`git archive`, once, under
the cache directory), starts a Python child on that tree, and asks it for bench.engine's own measures:
the child runs this tree's `bench/engine.py` measures against the old `engine` package (its float32
weights, its model code), with the modules that moved since then given their old names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.model_cache import cache_dir

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import importlib, importlib.util, json, sys, types
import torch
bench_file, model, dtype, threads, num_blocks, max_batch, max_step = sys.argv[1:8]
if int(threads):
    torch.set_num_threads(int(threads))
try:
    importlib.import_module("engine.params")
except ImportError:
    sys.modules["engine.params"] = importlib.import_module("engine.sampling")
try:
    importlib.import_module("engine.model_files")
except ImportError:
    files = types.ModuleType("engine.model_files")
    files.DEFAULT_MODEL = model
    files.resolve_model_path = None
    sys.modules["engine.model_files"] = files
spec = importlib.util.spec_from_file_location("bench_engine_of_this_tree", bench_file)
measures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(measures)
from engine.engine import EngineConfig, LLMEngine
from engine.loader import load_model
engine = LLMEngine(load_model(model, dtype), EngineConfig(dtype=dtype, num_blocks=int(num_blocks),
                   max_batch=int(max_batch), max_step_tokens=int(max_step), enable_prefix_cache=False))
print("@@" + json.dumps({"ready": True}), flush=True)
run = None
for line in sys.stdin:
    kind, *args = line.split()
    if kind == "prefill":
        value = measures.engine_prefill(engine, int(args[0]), int(args[1]))
    elif kind == "decode":
        run = measures.DecodeRun(engine, int(args[0]), int(args[1]))
        value = 0.0
    elif kind == "step":
        value = run.step()
    elif kind == "close":
        run.close()
        value = 0.0
    else:
        raise SystemExit(f"bench.baseline: unknown command {kind!r}")
    print("@@" + json.dumps({"value": value}), flush=True)
"""


def source_tree(rev: str) -> Path:
    """`rev` of this repository as files (extracted once per commit)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"], check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = cache_dir() / "bench-baseline" / sha
    if not (tree / "engine").is_dir():
        tmp = tree.with_name(sha + ".partial")
        tmp.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        tmp.rename(tree)
    return tree


class Baseline:
    """The engine of commit `rev` in a child process, answering bench.engine's prefill and decode measures."""

    def __init__(self, rev: str, model: str, dtype: str, threads: int, num_blocks: int, max_batch: int,
                 max_step_tokens: int):
        self.rev = rev
        tree = source_tree(rev)
        env = dict(os.environ, PYTHONPATH=str(tree))
        args = [str(ROOT / "bench" / "engine.py"), model, dtype, str(threads), str(num_blocks), str(max_batch),
                str(max_step_tokens)]
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], cwd=tree, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._reply()

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise RuntimeError(f"the baseline engine ({self.rev}) stopped with exit code {self.proc.wait()}")

    def ask(self, *command: object) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, command)) + "\n")
        self.proc.stdin.flush()
        return float(self._reply()["value"])

    def prefill(self, n: int, seed: int) -> float:
        """Prompt tok/s of one whole prefill of `n` tokens (bench.engine.engine_prefill)."""
        return self.ask("prefill", n, seed)

    def start_decode(self, batch: int, seed: int) -> BaselineDecode:
        """A batch prefilled in the child, to be decoded a step at a time (bench.engine.DecodeRun)."""
        self.ask("decode", batch, seed)
        return BaselineDecode(self)

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class BaselineDecode:
    """The child's DecodeRun: `step` and `close` as bench.engine.DecodeRun's (a step's time is the child's own)."""

    def __init__(self, baseline: Baseline):
        self.baseline = baseline

    def step(self) -> float:
        return self.baseline.ask("step")

    def close(self) -> None:
        self.baseline.ask("close")
