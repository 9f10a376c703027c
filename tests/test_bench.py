"""`tandem bench`: prompts of exact token lengths, arrivals, the figures and goodput, the stream parsing
(llama-server's way too), and the whole command against a real `tandem up` — whose default layout
really pins prefill and decode to their own cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from bench.cluster import TandemUp, cpus_allowed
from bench.datasets import FileDataset, PromptBuilder, SyntheticDataset, is_long
from bench.loadgen import Load, Options, RequestRecord, Stop, arrival_gaps, chunk_gaps, run_level, send
from bench.results import SCHEMA, latency_stats, meets, parse_slo, summarize
from bench.target import Target, identify, normalize_base_url
from engine.model_files import DEFAULT_MODEL, load_text
from runtime.placement import available_cpus, format_cpus, plan_layout

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    text = load_text(DEFAULT_MODEL)
    return PromptBuilder(text.tokenizer, text.chat_template)


def rendered_tokens(messages: list[dict[str, str]]) -> int:
    text = load_text(DEFAULT_MODEL)
    return len(text.tokenizer.encode(text.chat_template.render(messages)))


# ============================================================================ datasets


def test_prompts_have_the_asked_token_length(builder: PromptBuilder) -> None:
    """A "2,000-token prompt" is 2,000 tokens of the served model, chat template included."""
    for n in (40, 256, 2000):
        p = SyntheticDataset("random", builder, input_len=n).get(n)
        assert p.input_tokens == n == rendered_tokens(p.messages)
    text = load_text(DEFAULT_MODEL)
    p = SyntheticDataset("random", builder, endpoint="completions", input_len=300).get(0)
    assert p.messages is None and len(text.tokenizer.encode(p.text)) == 300 == p.input_tokens
    # shorter than the template: the shortest possible prompt, its true length recorded
    p = SyntheticDataset("random", builder, input_len=5).get(0)
    assert p.input_tokens == rendered_tokens(p.messages) > 5


def test_random_prompts_are_distinct_and_repeatable(builder: PromptBuilder) -> None:
    d = SyntheticDataset("random", builder, input_len=64, output_len=16, range_ratio=0.5, seed=3)
    prompts = [d.get(i) for i in range(40)]
    assert d.get(7) == prompts[7]  # a pure function of (seed, index)
    firsts = {tuple(p.messages[-1]["content"].split()[:3]) for p in prompts}
    assert len(firsts) == 40  # no shared prefix beyond the template's system prompt
    assert all(32 <= p.input_tokens <= 96 and 8 <= p.max_tokens <= 24 for p in prompts)
    assert len({p.input_tokens for p in prompts}) > 5
    other = SyntheticDataset("random", builder, input_len=64, seed=4).get(7)
    assert other.messages != prompts[7].messages


def test_shared_prefix_and_mixed(builder: PromptBuilder) -> None:
    d = SyntheticDataset("shared-prefix", builder, input_len=50, prefix_len=100, num_prefixes=3)
    ps = [d.get(i) for i in range(6)]
    systems = [p.messages[0]["content"] for p in ps]
    assert systems[0] == systems[3] and systems[1] == systems[4] and len(set(systems)) == 3
    base = rendered_tokens([{"role": "system", "content": systems[0]}])
    assert all(p.input_tokens == base + 50 == rendered_tokens(p.messages) for p in ps[:1])
    assert 95 <= base - rendered_tokens([{"role": "system", "content": ""}]) <= 105
    m = SyntheticDataset("mixed", builder, input_len=30, output_len=20, long_share=0.25, long_tokens=500,
                         long_output_len=4)
    kinds = [m.get(i).kind for i in range(12)]
    assert kinds == ["short", "short", "short", "long"] * 3  # evenly spaced, a fixed share
    long = m.get(3)
    assert (long.input_tokens, long.max_tokens) == (500, 4) and m.get(0).max_tokens == 20
    assert [is_long(i, 0.1) for i in range(20)].count(True) == 2
    with pytest.raises(ValueError, match="--long-share must be between 0 and 1"):
        SyntheticDataset("mixed", builder, long_share=2)
    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        SyntheticDataset("nope", builder)


def test_jsonl_dataset(tmp_path: Path, builder: PromptBuilder) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5, "kind": "chat"}\n\n'
                 '{"prompt": "Once upon a time"}\n')
    d = FileDataset.load(f, builder, 9)
    assert [p.max_tokens for p in d.prompts] == [5, 9] and d.get(3) == d.prompts[1]
    assert d.prompts[0].kind == "chat" and d.prompts[1].text == "Once upon a time" and d.prompts[1].input_tokens == 4
    for line, why in (("nope", "d.jsonl:1: not JSON"), ('{"max_tokens": 3}', 'exactly one of "messages" or "prompt"'),
                      ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be a positive integer"),
                      ('{"messages": "hi"}', '"messages" must be a list')):
        f.write_text(line + "\n")
        with pytest.raises(ValueError, match=why):
            FileDataset.load(f, builder, 9)


# ============================================================================ load and figures


def test_arrivals_are_gamma_with_the_asked_rate() -> None:
    for burstiness in (1.0, 0.25):
        gap = arrival_gaps(4.0, burstiness, random.Random(1))
        xs = [gap() for _ in range(20000)]
        assert statistics.fmean(xs) == pytest.approx(0.25, rel=0.05)
        cv2 = statistics.pvariance(xs) / statistics.fmean(xs) ** 2  # gamma: CV² = 1 / shape
        assert cv2 == pytest.approx(1 / burstiness, rel=0.1)
    assert arrival_gaps(float("inf"), 1.0, random.Random(1))() == 0.0


def test_gaps_tpot_goodput() -> None:
    r = RequestRecord(0, "short", 0.0, output_tokens=6, ttft=0.1, e2e=0.6,
                      chunks=[(0.1, 1), (0.2, 1), (0.5, 3), (0.6, 1)])
    assert [t for t, _ in chunk_gaps(r.chunks)] == [0.2, 0.5, 0.5, 0.5, 0.6]  # the chunk of 3 is 3 gaps
    assert r.gaps() == pytest.approx([0.1] * 5)
    assert r.tpot() == pytest.approx(0.1)
    slow = RequestRecord(1, "long", 1.0, output_tokens=2, ttft=2.0, e2e=2.5, chunks=[(2.0, 1), (2.5, 1)])
    failed = RequestRecord(2, "short", 2.0, error_kind="http_503:no_workers", error="x")
    assert meets(r, {"ttft": 100, "itl": 100, "tpot": 100}) and not meets(r, {"itl": 99})
    assert not meets(slow, {"ttft": 1000}) and meets(slow, {"itl": 500}) and not meets(slow, {"tpot": 499})
    assert not meets(failed, {})
    s = summarize([r, slow, failed], 4.0, parse_slo(["ttft:1000", "itl:200"]))
    assert s["goodput"] == {"requests_per_s": 0.25, "met": 1, "share": 0.3333}
    assert s["requests"] == {"sent": 3, "completed": 2, "failed": 1} and s["errors"] == {"http_503:no_workers": 1}
    assert s["throughput"]["output_tokens_per_s"] == 2.0 and s["latency_ms"]["itl"]["count"] == 6
    assert summarize([r], 1.0, {})["goodput"] is None
    values = [random.Random(i).random() for i in range(101)]
    st = latency_stats(values)
    for q, key in ((50, "p50"), (90, "p90"), (99, "p99")):
        assert st[key] == pytest.approx(np.percentile(np.array(values) * 1000, q), abs=1e-3)
    assert latency_stats([])["p99"] is None
    for bad in ("ttft", "e2e:5", "itl:x", "ttft:-1"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_slo([bad])


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def fake_llama_server(seen: list[dict]) -> httpx.MockTransport:
    """What llama-server answers: /props, one token per chunk, no usage in the stream."""
    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "smol.gguf", "owned_by": "llamacpp"}]})
        if path == "/props":
            return httpx.Response(200, json={"total_slots": 16, "n_ctx": 32768, "build_info": "b1", "other": 1})
        body = json.loads(request.content)
        seen.append(body)
        content = body["messages"][0]["content"]
        if content == "busy":
            return httpx.Response(503, json={"error": {"message": "no slot", "code": "no_workers"}})
        words = [{"choices": [{"delta": {"content": w}}]} for w in (" The", " capital", " is", " Paris")]
        if content == "cut":
            return httpx.Response(200, content=sse(*words[:2]))
        if content == "fails":
            return httpx.Response(200, content=sse(words[0], {"error": {"message": "boom", "code": "worker_lost"}},
                                                   b"[DONE]"))
        if content == "pieces":  # two tokens in one chunk, the bytes arriving 3 at a time (lines cut anywhere)
            body = sse(words[0], {"choices": [{"delta": {"content": " capital is"}}]}, words[3], b"[DONE]")

            async def by_three():
                for i in range(0, len(body), 3):
                    yield body[i:i + 3]
            return httpx.Response(200, content=by_three())
        return httpx.Response(200, content=b": keep-alive\n\n" + sse({"choices": [{"delta": {"role": "assistant"}}]},
                                                                     *words, b"[DONE]"))
    return httpx.MockTransport(handler)


def test_stream_parsing_and_server_identity() -> None:
    from bench.datasets import Prompt

    seen: list[dict] = []
    transport = fake_llama_server(seen)
    target = Target("http://llama:8080/v1", "smol.gguf")

    async def go() -> tuple[dict, list[RequestRecord]]:
        async with httpx.AsyncClient(transport=transport) as client:
            server = await identify(client, "http://llama:8080/v1")
            recs = [await send(client, target, Prompt([{"role": "user", "content": c}], None, 4, None), i, 0.0,
                               Options(count_tokens=lambda text: len(text.split())))
                    for i, c in enumerate(("ok", "busy", "cut", "fails", "pieces"))]
        return server, recs

    server, (ok, busy, cut, fails, pieces) = asyncio.run(go())
    assert server["kind"] == "llama.cpp" and server["models"] == ["smol.gguf"]
    assert server["props"] == {"total_slots": 16, "n_ctx": 32768, "build_info": "b1"}
    assert seen[0]["ignore_eos"] is True and seen[0]["stream"] is True and seen[0]["max_tokens"] == 4
    assert seen[0]["stream_options"] == {"include_usage": True}
    assert ok.ok and ok.output_tokens == 4 and ok.usage_source == "counted" and len(ok.chunks) == 4
    assert ok.ttft == ok.chunks[0][0] and ok.e2e >= ok.ttft
    assert (busy.error_kind, busy.error) == ("http_503:no_workers", "no slot")
    assert cut.error_kind == "incomplete" and fails.error_kind == "stream_error:worker_lost"
    assert len(cut.chunks) == 2 and len(fails.chunks) == 1  # what arrived before the stream went wrong
    assert pieces.ok and [k for _, k in pieces.chunks] == [1, 2, 1] and pieces.output_tokens == 4
    assert len(pieces.gaps()) == 3
    assert normalize_base_url("http://h:1/") == normalize_base_url("http://h:1/v1") == "http://h:1/v1"
    with pytest.raises(ValueError, match="expected http://host:port"):
        normalize_base_url("h:1")


class Counting:
    """Progress that counts."""

    def __init__(self) -> None:
        self.started = self.done = 0

    def sent(self) -> None:
        self.started += 1

    def finished(self, record: RequestRecord) -> None:
        self.done += 1


def test_tokenizer_is_the_served_model_when_local() -> None:
    from argparse import Namespace

    from bench.command import _tokenizer_spec

    assert _tokenizer_spec(Namespace(tokenizer="auto"), MODEL) == MODEL
    assert _tokenizer_spec(Namespace(tokenizer="auto"), "gpt-3.5-turbo") is None  # estimated, never another's
    assert _tokenizer_spec(Namespace(tokenizer="none"), MODEL) is None
    assert _tokenizer_spec(Namespace(tokenizer=MODEL), "gpt-3.5-turbo") == MODEL
    estimated = SyntheticDataset("random", PromptBuilder(), input_len=50).get(0)
    assert estimated.input_tokens is None and len(estimated.messages[-1]["content"].split()) == 50


def test_levels_send_what_they_say(builder: PromptBuilder) -> None:
    """Closed loop sends exactly --requests; an open-loop duration sends about rate × duration."""
    d = SyntheticDataset("random", builder, input_len=20, output_len=4)
    target = Target("http://llama:8080/v1", "smol.gguf")

    def level(load: Load, stop: Stop, progress: Counting) -> list[RequestRecord]:
        return asyncio.run(run_level(target, d, load, stop, Options(), progress,
                                     transport=fake_llama_server([]))).records

    progress = Counting()
    recs = level(Load(concurrency=3), Stop(requests=7), progress)
    assert [r.index for r in recs] == list(range(7)) and all(r.ok for r in recs)
    assert progress.started == progress.done == 7
    n = len(level(Load(rate=40.0), Stop(duration=0.5), Counting()))
    assert 5 <= n <= 60  # Poisson: about 20


# ============================================================================ against a real `tandem up`


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemUp]:
    """The default `tandem up`: one prefill_only and one decode_only worker, placed by default."""
    cluster = TandemUp(tmp_path_factory.mktemp("bench-up"), "--quiet", "--stop-timeout", "10",
                       "--worker-args", "--num-blocks 256").start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_up_places_prefill_and_decode_on_their_own_cores(up: TandemUp) -> None:
    """Decode on its own core at normal priority; prefill on its own, borrowing decode's at idle priority."""
    avail = available_cpus()
    if len(avail) < 2:
        pytest.skip("needs two cores")
    layout = plan_layout(1, 1, available=avail)
    prefill, decode = layout.prefill[0], layout.decode[0]
    for name, place in (("prefill-1", prefill), ("decode-1", decode)):
        pid = up.child_info(name)["pid"]
        assert cpus_allowed(pid) == {format_cpus([*place.cpus, *place.borrowed])}
        assert up.child_info(name)["placement"] == place.describe()
        policies = {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}
        assert policies == {os.SCHED_IDLE if name.startswith("prefill") else os.SCHED_OTHER}, (name, policies)
    if avail == [0, 1]:
        assert (prefill.cpus, prefill.borrowed, decode.cpus) == ((0,), (1,), (1,))
        assert (prefill.threads, decode.threads) == (2, 1)
    text = up.output()
    assert f"placement   each worker on its own cores; prefill borrows the decode cores while they idle; NATS and " \
           f"the gateway are light and run on any core ({format_cpus(avail)})" in text
    assert cpus_allowed(up.child_info("gateway")["pid"]) == {format_cpus(avail)}


RUN_KEYS = {"load", "duration_s", "requests", "tokens", "throughput", "latency_ms", "errors", "goodput", "by_kind",
            "records", "error_samples"}
RECORD_KEYS = {"index", "kind", "start_s", "ttft_s", "e2e_s", "prompt_tokens", "output_tokens", "usage_source",
               "chunks", "error_kind", "error"}


def run_bench(up: TandemUp, tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "out.json"
    res = subprocess.run([sys.executable, "-m", "tandem.cli", "bench", "--base-url", up.url, "--json", str(out),
                          "--plot", str(tmp_path / "out.png"), *args],
                         capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout + res.stderr + up.output()[-4000:]
    return json.loads(out.read_text()), res.stdout


def check_stats(st: dict) -> None:
    assert set(st) == {"mean", "p50", "p90", "p99", "max", "count"} and st["count"] > 0
    assert 0 < st["p50"] <= st["p90"] <= st["p99"] <= st["max"] and 0 < st["mean"] <= st["max"]


def test_bench_mixed_against_tandem_up(up: TandemUp, tmp_path: Path) -> None:
    slo = {"ttft": 4000.0, "itl": 400.0}
    data, stdout = run_bench(up, tmp_path, "--dataset", "mixed", "--long-share", "0.25", "--long-tokens", "300",
                             "--long-output-len", "6", "--input-len", "40", "--output-len", "8", "--requests", "8",
                             "--concurrency", "2", "--goodput", "ttft:4000", "itl:400")
    assert set(data) == {"schema", "started_at", "command", "server", "config", "runs"} and data["schema"] == SCHEMA
    assert data["server"]["kind"] == "tandem" and data["server"]["models"] == [MODEL]
    assert data["config"]["slo_ms"] == slo and data["config"]["dataset"]["exact_lengths"] is True
    [run] = data["runs"]
    assert set(run) == RUN_KEYS and run["load"] == {"mode": "concurrency", "concurrency": 2}
    assert run["requests"] == {"sent": 8, "completed": 8, "failed": 0} and run["errors"] == {}
    for name in ("ttft", "tpot", "itl", "e2e"):
        check_stats(run["latency_ms"][name])
    records = run["records"]
    assert all(set(r) == RECORD_KEYS for r in records)
    for r in records:
        long = r["kind"] == "long"
        # ignore_eos: exactly max_tokens out; the server's usage counts the prompt as we built it
        assert (r["prompt_tokens"], r["output_tokens"], r["usage_source"]) == ((300, 6, "server") if long
                                                                                else (40, 8, "server"))
        assert 0 < r["ttft_s"] <= r["e2e_s"] and r["chunks"][0][0] == r["ttft_s"]
    assert [r["kind"] for r in records] == ["short", "short", "short", "long"] * 2
    assert run["throughput"]["requests_per_s"] == pytest.approx(8 / run["duration_s"], rel=1e-3)
    assert run["throughput"]["output_tokens_per_s"] == pytest.approx((6 * 8 + 2 * 6) / run["duration_s"], rel=1e-3)
    assert run["tokens"] == {"input": 6 * 40 + 2 * 300, "output": 60, "output_usage_source": ["server"]}
    # goodput recounted here from the requests and the SLOs
    def met(r: dict) -> bool:
        gaps = [g for _, g in chunk_gaps(r["chunks"])]
        return r["ttft_s"] * 1000 <= slo["ttft"] and (not gaps or max(gaps) * 1000 <= slo["itl"])

    for kind, part in [("", run), *run["by_kind"].items()]:
        mine = [r for r in records if not kind or r["kind"] == kind]
        assert part["goodput"]["met"] == sum(map(met, mine))
        # both figures are rounded to 4 decimals (a short run's duration moves the quotient by more than 1e-4)
        assert part["goodput"]["requests_per_s"] == pytest.approx(part["goodput"]["met"] / run["duration_s"], rel=1e-3)
    assert set(run["by_kind"]) == {"short", "long"} and run["by_kind"]["long"]["requests"]["sent"] == 2
    assert "concurrency 2: 8 requests" in stdout and "goodput" in stdout
    if len(available_cpus()) >= 2:  # the long prompts were prefilled by the prefill worker, which borrows
        from bench.report import metric_samples  # decode's core and counts where their layers ran

        port = up.child_info("prefill-1")["metrics_port"]
        layers = {s.labels["cores"]: s.value for s in metric_samples(f"http://127.0.0.1:{port}/metrics")
                  if s.name == "tandem_worker_layers_total"}
        assert set(layers) == {"own", "borrowed"} and sum(layers.values()) >= 30, layers
    png = (tmp_path / "out.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_bench_rate_sweep(up: TandemUp, tmp_path: Path) -> None:
    data, _ = run_bench(up, tmp_path, "--dataset", "random", "--input-len", "30", "--output-len", "4",
                        "--rate", "2,8", "--burstiness", "0.5", "--requests", "3", "--warmup", "0",
                        "--goodput", "tpot:100000")
    assert [r["load"] for r in data["runs"]] == [{"mode": "rate", "rate": 2.0, "burstiness": 0.5},
                                                 {"mode": "rate", "rate": 8.0, "burstiness": 0.5}]
    for run in data["runs"]:
        assert run["requests"]["completed"] == 3 and run["goodput"]["met"] == 3 and run["by_kind"] == {}
    # each level its own prompts: no prefix shared with the level before
    first = {r["index"] for r in data["runs"][0]["records"]}
    assert first.isdisjoint({r["index"] for r in data["runs"][1]["records"]})
    assert (tmp_path / "out.png").stat().st_size > 20_000


@pytest.mark.parametrize("args, message, code", [
    (["--rate", "1", "--concurrency", "2"], "not allowed with argument", 2),
    (["--goodput", "e2e:5"], "tandem bench: --goodput 'e2e:5': expected NAME:MS", 2),
    (["--rate", "0"], "tandem bench: --rate '0': rates must be positive", 2),
    (["--dataset", "nope.jsonl"], "tandem bench: --dataset 'nope.jsonl': choose random", 2),
    (["--base-url", "http://127.0.0.1:9"], "tandem bench: cannot reach http://127.0.0.1:9/v1/models", 1),
])
def test_bench_bad_input_is_one_clear_line(args: list[str], message: str, code: int) -> None:
    base = [] if any(a == "--base-url" for a in args) else ["--base-url", "http://127.0.0.1:9"]
    res = subprocess.run([sys.executable, "-m", "tandem.cli", "bench", *base, *args], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == code and message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_pd_bench_sweeps_the_local_prefill_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.pd_vs_aggregated as pd

    monkeypatch.setattr(pd, "available_cpus", lambda: [4, 5])
    sweep = pd.layouts([0, 64], stall_budget_ms=25)
    assert sweep["disaggregated-lp0"] == ["--prefill-cpus", "4,5", "--decode-cpus", "5", "--worker-args",
                                          "--local-prefill-max-tokens 0 --prefill-stall-budget-ms 25"]
    assert sweep["disaggregated-pinned"] == ["--prefill-cpus", "4", "--decode-cpus", "5"]
    assert sweep["disaggregated-lp64"][-1] == "--local-prefill-max-tokens 64 --prefill-stall-budget-ms 25"
    assert "disaggregated-lp0" not in pd.layouts()


def test_pd_report_checks_the_targets_and_names_where_prompts_were_prefilled() -> None:
    import argparse

    import bench.pd_vs_aggregated as pd

    def row(layout: str, rate: float, itl: float, good: float, decisions: dict | None = None) -> dict:
        return {"layout": layout, "rate": rate, "short_itl_p99": itl, "short_ttft_p90": 900.0,
                "short_tok_s": 100 * good, "long_ttft_p50": 5000.0 if layout == "aggregated-512" else 6500.0,
                "long_ttft_p90": 9000.0, "goodput": good, "goodput_short": good, "failed": 0,
                "prefill_decisions": decisions or {}}

    table = [row("disaggregated", 0.25, 90, 0.24, {"remote/decode_stall": 30, "local/prefill_backlog": 2}),
             row("disaggregated", 0.5, 160, 0.2), row("aggregated-512", 0.25, 120, 0.2),
             row("aggregated-512", 0.5, 600, 0.05)]
    args = argparse.Namespace(rates="0.25,0.5", duration=60.0, input_len=100, output_len=100, long_tokens=2000,
                              long_output_len=16, long_share=0.1, slo_ttft=3000.0, slo_itl=150.0,
                              local_prefill_max_tokens=None)
    text = pd.markdown(table, args)
    assert text.startswith("## Experiment 1")
    # the first rate where aggregated-512 passes 150 ms is 0.5: 160 / 600 and 0.2 / 0.05
    assert "At 0.5 req/s" in text and "0.27× (target ≤ 0.25×: missed)" in text and "4.00× (target ≥ 2×: met)" in text
    assert "output 4.00× aggregated-512's (target ≥ 0.8×: met)" in text
    assert "TTFT p50 1.30× (target ≤ 1.2×: missed)" in text
    assert "| disaggregated | 0.25 | 90 ms | 900 ms | 24.0 | 6500 ms | 9000 ms | 0.240 | 0.240 | 0 |" in text
    assert "- disaggregated: remote/decode_stall 30, local/prefill_backlog 2" in text
    args.local_prefill_max_tokens = "0,32"
    sweep = pd.markdown([r for r in table if r["layout"] == "disaggregated"], args)
    assert sweep.startswith("## Experiment 3") and "--local-prefill-max-tokens 0,32" in sweep
    assert "measured only one of them" in sweep


def test_engine_bench_decodes_in_turns_a_step_each() -> None:
    """bench.engine's decode: every engine holds its own batch and they take turns a step at a time; a whole
    runner (llama-server) takes its turn after each round; a warm-up round of each comes first; a read of memory
    takes its turn every PROBE_EVERY steps, its rates kept from the timed rounds only."""
    from bench import engine_turns

    log: list[tuple] = []

    class Run:
        def __init__(self, name: str, r: int):
            self.name, self.r = name, r
            log.append(("start", name, r))

        def step(self) -> float:
            log.append(("step", self.name, self.r))
            return {"a": 0.5, "b": 0.25}[self.name]

        def close(self) -> None:
            log.append(("close", self.name, self.r))

    class Probe:
        def rate(self) -> float:
            log.append(("probe", len(log)))
            return 30e9 + len(log)

    starts = {"a": lambda r: Run("a", r), "b": lambda r: Run("b", r)}
    bandwidth: list[float] = []
    got = engine_turns.interleaved_decode(starts, {"w": lambda r: log.append(("whole", r)) or 7.0}, 4, 2, Probe(),
                                          bandwidth)
    assert got == {"a": 8.0, "b": 16.0, "w": 7.0}
    probes = [e for e in log if e[0] == "probe"]
    steps_per_round = engine_turns.DECODE_STEPS
    assert len(probes) == 3 * steps_per_round // engine_turns.PROBE_EVERY  # the warm-up round's too
    assert len(bandwidth) == 2 * steps_per_round // engine_turns.PROBE_EVERY  # kept: the timed rounds'
    log[:] = [e for e in log if e[0] != "probe"]
    for r in (-1, 0, 1):
        turns = [e for e in log if e[-1] == r and e[0] != "whole"]
        assert turns[:2] == [("start", "a", r), ("start", "b", r)] and turns[-2:] == [("close", "a", r), ("close", "b", r)]
        assert [e[1] for e in turns[2:-2]] == ["a", "b"] * steps_per_round
    assert [e for e in log if e[0] == "whole"] == [("whole", -1), ("whole", 0), ("whole", 1)]
    assert log.index(("whole", 0)) > log.index(("close", "b", 0)) and log.index(("whole", 0)) < log.index(("start", "a", 1))


def test_engine_bench_sets_torch_operations_and_plain_pages_beside_the_native_ones(monkeypatch) -> None:
    """`bench.engine --torch-ops --plain-pages` measures each format three times: the second engine without
    engine.native, the third with its packed weights on 4 KiB pages."""
    from bench import engine as engine_bench
    from engine import native
    from engine.native import huge_pages

    monkeypatch.setattr(engine_bench, "start_times", lambda *a: (0.0, 0.0))  # cold loads: not what this checks
    built = []
    real = engine_bench.LLMEngine

    def recording(*a, **kw):
        built.append(real(*a, **kw))
        return built[-1]

    monkeypatch.setattr(engine_bench, "LLMEngine", recording)
    report = engine_bench.run("smollm2-135m-instruct", "float32", ["auto"], [1], [16], 1, peer=False,
                              torch_ops=True, plain_pages=True)
    header = next(line for line in report.splitlines() if line.startswith("| measure"))
    assert header.split(" | ")[1:] == ["auto (auto:int4+q8_0)", "auto (auto:int4+q8_0), torch ops",
                                       "auto (auto:int4+q8_0), 4 KiB pages |"]
    assert [e.model.native for e in built] == [native.available(), False, native.available()]
    rows = [line for line in report.splitlines() if line.startswith(("| prefill", "| decode"))]
    assert len(rows) == 2 and all(float(c.replace(",", "")) > 0 for r in rows for c in r.strip("|").split("|")[1:])
    # the CPU's peaks this run, and each engine's roofline at them (the same matmul kernels in every column)
    assert "This CPU's peaks" in report and "float32 FMA" in report and "GB/s" in report
    [peak] = [line for line in report.splitlines() if line.startswith("| roofline: prefill")]
    precision = native.PANEL_PRECISION.get(native.kernel_path(), "float32")
    assert peak.count(f"({precision})") == 3
    # the read roofline twice: at the peaks' read, and at the median of reads taking turns with the batch-1 steps
    for label in (engine_bench.READ_ROOF, engine_bench.BETWEEN_ROOF):
        [read] = [line for line in report.splitlines() if line.startswith(f"| {label} |")]
        assert all(float(c.replace(",", "")) > 0 for c in read.strip("|").split("|")[1:]), read
    assert "between batch-1 steps, reads at a median" in report
    # a prompt chunk's matmuls measured beside those peaks, as a share of the matmul peak
    chunk = [line for line in report.splitlines() if line.startswith(f"| {engine_bench.CHUNK_RATE}")]
    if native.available():
        [row] = chunk
        cells = [c.strip() for c in row.strip("|").split("|")[1:]]
        shares = [float(c.split("(")[1].rstrip("%)")) for c in cells]
        assert len(shares) == 3 and all(0 < share < 200 for share in shares), row
    else:
        assert not chunk
    # the packed weights in 2 MiB pages where the kernel grants them, and not in the 4 KiB pages' column
    [pages] = [line for line in report.splitlines() if line.startswith(f"| {engine_bench.HUGE_ROW}")]
    huge, torch_ops, plain = (float(c.replace(",", "")) for c in pages.strip("|").split("|")[1:])
    assert plain == 0
    if native.available() and native.packs_i8() and huge_pages.transparent_huge_pages() != "never":
        assert huge > 90 and torch_ops > 90, pages  # ~97 MB of panels, in 2 MiB pages (a mapping's tail may not be)
    else:
        assert huge == torch_ops == 0


def test_baseline_engine_answers_bench_engines_measures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.engine --baseline REV: REV's tree is extracted once and its engine, in a child process, answers
    the prefill measure and decodes a batch a step at a time (here REV is HEAD, so the child's engine is this
    one)."""
    import bench.baseline
    from bench.baseline import Baseline, source_tree

    monkeypatch.setattr(bench.baseline, "cache_dir", lambda: tmp_path)
    tree = source_tree("HEAD")
    assert (tree / "engine" / "engine.py").is_file() and source_tree("HEAD") == tree
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    old = Baseline("HEAD", DEFAULT_MODEL, "float32", 1, num_blocks=64, max_batch=2, max_step_tokens=128)
    try:
        assert old.prefill(16, 1) > 0
        run = old.start_decode(2, 1)
        steps = [run.step() for _ in range(3)]
        run.close()
        assert all(0 < t < 60 for t in steps)
        again = old.start_decode(2, 2)  # the child takes the next batch after a close
        assert again.step() > 0
        again.close()
    finally:
        old.stop()
    assert old.proc.returncode == 0
    with pytest.raises(subprocess.CalledProcessError):
        source_tree("no-such-rev")


def test_kernel_ab_takes_turns_between_two_builds_of_ops_c(capsys):
    """bench.kernel_ab with the installed library as the old one too: every measure (matmuls, attention in each precision, a prompt,
    decode steps) prints both columns and their ratio, the two give the same bits, and engine.native calls its own
    library again afterwards."""
    import torch

    from bench import kernel_ab
    from engine import native
    from engine.native import dispatch
    from engine.native.build import VARIANTS

    if native.library() is None:
        pytest.skip("engine.native is not built here")
    lib = dispatch.variant_file(next(v for v in VARIANTS if v.name == native.variant()))
    threads, real = torch.get_num_threads(), native.library
    try:
        assert kernel_ab.main(["--old", str(lib), "--rows", "13", "--chunks", "130:200", "--prefill", "130",
                               "--rounds", "1", "--threads", "1", "--decode", "2", "--decode-turns", "3",
                               "--decode-context", "40"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert native.library is real
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "x |" in line]
    # the same library twice: what its build multiplies in (bfloat16 and int8 panels: AVX-512 BF16, VNNI) and
    # attends in (float32 on any AVX-512 build, bfloat16 too with BF16)
    bf16, vnni = (p in native.kernel_paths() for p in ("avx512_bf16", "avx512_vnni"))
    attends = native.has_chunk_attention()
    prefill_path = "avx512_vnni" if vnni else "avx512_bf16" if bf16 else native.kernel_path()
    assert [r.split(" |")[0] for r in rows] == [*(["| bfloat16 matmul, 13 rows (GFLOP/s)"] if bf16 else []),
                                                 *(["| int8 matmul, 13 rows (GFLOP/s)"] if vnni else []),
                                                 *(["| float32 attention, 130 rows over 200 tokens (ms)"] if attends
                                                   else []),
                                                 *(["| bfloat16 attention, 130 rows over 200 tokens (ms)"] if bf16
                                                   else []),
                                                 f"| prefill on {prefill_path}, 130 tokens (prompt tok/s)",
                                                 f"| decode batch 2 over 40 tokens on {native.kernel_path()} (ms a step)"]
    assert all(r.endswith("| yes |") for r in rows[:-2])
    with pytest.raises(SystemExit):
        kernel_ab.main([])  # --old or --baseline is required


def test_long_beside_streams_table_and_flags() -> None:
    from bench import long_beside_streams as lbs

    assert lbs.words(3, 10) == lbs.words(3, 10) and lbs.words(3, 10) != lbs.words(4, 10)
    assert len(lbs.words(1, 690).split()) == 690
    assert lbs.quantile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0 and lbs.quantile([1.0, 9.0], 0.99) == 9.0
    row = {"prompt_tokens": 2001, "gap_p50_ms": 20.0, "gap_p99_ms": 60.0, "gap_max_ms": 90.0, "gaps": 10}
    text = lbs.table({"disaggregated": {**row, "ttft_ms": 3000.0}, "aggregated-512": {**row, "ttft_ms": 1500.0}})
    assert "| disaggregated | 2001 | 3,000 ms | 2.00x | 20.0 ms | 60 ms | 90 ms |" in text
    assert "| aggregated-512 | 2001 | 1,500 ms | 1.00x |" in text
    alone = lbs.table({"disaggregated": {**row, "ttft_ms": 1600.0, "gaps": 0}})
    assert alone.endswith("| disaggregated | 2001 | 1,600 ms | 1.00x | - | - | - |")
    shared = {"own_s": 6.0, "borrowed_s": 4.0, "lent_s": 5.0, "prompts_s": 10.0, "wait_s": 0.4, "waits": 100}
    none = dict.fromkeys(shared, 0.0)
    text = lbs.lending_table({"disaggregated": shared, "aggregated-512": none})
    assert text.splitlines()[2] == "| disaggregated | 40% | 0.50 | 80% | 4.0 ms |" and "aggregated-512" not in text
    assert lbs.lending_table({"aggregated-512": none}) == ""
    with pytest.raises(SystemExit) as bad:
        lbs.main(["--layouts", "nonesuch"])
    assert bad.value.code == 2
    with pytest.raises(SystemExit) as bad:
        lbs.main(["--env", "NOEQUALS"])
    assert bad.value.code == 2
