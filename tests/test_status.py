"""`tandem status` and `tandem tail` against a real nats-server and a real worker process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from bench.cluster import MODEL, cpus_allowed, tandem_cmd
from bus.server import EmbeddedNats
from bus.subjects import Subjects
from bus.wire import REQUEST_ID_HEADER
from tests.harness.chat import chat_prompt_ids
from tests.harness.cluster import Proc, run_cli

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
WORKER = "s1"
BLOCKS = 64
PIN = max(os.sched_getaffinity(0))  # s1 runs on this core alone (`tandem serve --cpus`)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def worker_proc() -> Iterator[tuple[str, int, Proc]]:
    """NATS + one prefill_and_decode worker `s1` with 64 blocks and a metrics port, pinned to core PIN."""
    with EmbeddedNats() as srv:
        metrics_port = free_port()
        worker = Proc(tandem_cmd("--log-level", "INFO", "serve", "--pipeline-role", "prefill_and_decode",
                                 "--worker-id", WORKER, "--nats-url", srv.url, "--num-blocks", str(BLOCKS),
                                 "--metrics-port", str(metrics_port), "--cpus", str(PIN)),
                      env={"UCX_NET_DEVICES": "lo"})
        try:
            worker.wait_for("ready", timeout=180)
            yield srv.url, metrics_port, worker
        finally:
            worker.stop()


@pytest.fixture(scope="module")
def cluster(worker_proc: tuple[str, int, Proc]) -> tuple[str, int]:
    return worker_proc[0], worker_proc[1]


def test_cpus_pins_every_thread_of_the_worker(worker_proc: tuple[str, int, Proc]) -> None:
    """`tandem serve --cpus N`: the process and all its threads (model, bus, metrics) may run on N only."""
    pid = worker_proc[2].pid
    assert len(list(Path(f"/proc/{pid}/task").iterdir())) > 2
    assert cpus_allowed(pid) == {str(PIN)}
    assert any(f"on cores {PIN} with 1 torch threads" in line for line in worker_proc[2].err), worker_proc[2].text()


def test_status_json_lists_the_worker(cluster: tuple[str, int]) -> None:
    url, metrics_port = cluster
    t0 = time.monotonic()
    res = run_cli("status", "--json", "--wait", "3", "--nats-url", url)  # a busy worker may answer late
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["namespace"] == "tandem"
    [w] = [w for w in data["workers"] if w["worker_id"] == WORKER]
    assert w["role"] == "prefill_and_decode" and w["model"] == MODEL
    assert w["service"] == "tandem-prefill-and-decode"
    assert w["total_blocks"] == BLOCKS and 0 <= w["free_blocks"] <= BLOCKS
    assert w["used_blocks"] == BLOCKS - w["free_blocks"]
    assert w["running"] == 0 and w["queued"] == 0 and w["max_batch"] > 0
    assert w["prefill_workers"] is None  # only a decode_only worker counts the prefill workers it sends to
    assert 0.0 <= w["prefix_hit_rate"] <= 1.0 and w["uptime"] > 0
    assert w["metrics_url"].endswith(f":{metrics_port}/metrics")
    assert w["stats_error"] is None and w["incarnation"] and w["restarts"] == 0
    assert (w["cpus"], w["threads"], w["device"]) == (str(PIN), 1, "cpu")
    assert w["kernels"] in ("avx512_vnni", "neon_dotprod", "avx512_bf16", "avx2", "portable", "torch")  # engine.native.kernel_path()
    s = Subjects(MODEL)
    pools = {p["pool"]: p for p in data["pools"]}
    assert pools["generate"]["stream"] == s.generate_stream and pools["generate"]["consumer"] == s.generate_consumer
    assert pools["prefill"]["stream"] == s.prefill_stream
    assert pools["generate"]["pending"] == 0 and pools["generate"]["error"] is None
    assert time.monotonic() - t0 < 30


def test_status_table_and_filters(cluster: tuple[str, int]) -> None:
    url, metrics_port = cluster
    res = run_cli("status", "--wait", "3", "--nats-url", url)
    assert res.returncode == 0, res.stderr
    assert "1 worker" in res.stdout
    row = next(line for line in res.stdout.splitlines() if f" {WORKER} " in line)
    assert "prefill_and_decode" in row and MODEL in row and f"/{BLOCKS} (" in row and str(metrics_port) in row
    assert re.search(rf" cores {PIN} ×1 (avx512_vnni|avx512_bf16|avx2|portable|torch) ", row)
    other = json.loads(run_cli("status", "--json", "--nats-url", url, "--namespace", "elsewhere").stdout)
    assert other["workers"] == []
    none = json.loads(run_cli("status", "--json", "--nats-url", url, "--model", "another-model").stdout)
    assert none["workers"] == []


def test_status_unreachable_nats_is_a_clear_error() -> None:
    t0 = time.monotonic()
    res = run_cli("status", "--nats-url", f"nats://127.0.0.1:{free_port()}", "--timeout", "1")
    assert res.returncode == 1
    assert "cannot reach NATS" in res.stderr and "Traceback" not in res.stderr
    assert time.monotonic() - t0 < 20


def test_tail_prints_one_request_decoded(cluster: tuple[str, int]) -> None:
    url, _ = cluster
    client_id = f"chatcmpl-{uuid.uuid4().hex}"
    rid = f"{client_id}-0"  # how the gateway names a client's first choice
    tail = Proc(tandem_cmd("tail", "--nats-url", url, "--request", client_id, "--until-done", "--timeout", "120",
                           "--width", "0"))
    try:
        tail.wait_for("following tandem.>", timeout=60)
        s = Subjects(MODEL)
        body = {"kind": "generate_request", "request_id": rid, "prompt_ids": chat_prompt_ids(
            "What is the capital of France?"), "stream_subject": s.stream("gwtest", rid),
            "sampling": {"max_tokens": 12, "temperature": 0.0}, "deadline": time.time() + 120}

        async def send() -> None:
            nc = await nats.connect(url)
            try:
                await nc.jetstream().publish(s.generate_pool, json.dumps(body).encode(),
                                             headers={REQUEST_ID_HEADER: rid})
            finally:
                await nc.close()

        asyncio.run(send())
        assert tail.wait(150) == 0, tail.text()
    finally:
        tail.stop()
    lines = tail.out
    assert all(f"rid={rid}" in line for line in lines), tail.text()
    kinds = [line.split()[2] for line in lines]
    assert kinds[0] == "generate_request" and kinds[-1] == "stream_finish", kinds
    assert "stream_tokens" in kinds
    first = lines[0]
    assert f" {s.generate_pool} " in first and "capital of France?" in first  # prompt ids decoded
    generated = "".join(line.split('"')[1] for line in lines if " stream_tokens " in line)
    assert "Paris" in generated, tail.text()
    assert "decode by s1" in lines[-1]


def test_tail_count_stops(cluster: tuple[str, int]) -> None:
    url, _ = cluster
    t0 = time.monotonic()
    res = run_cli("tail", "--nats-url", url, "--count", "2", "--timeout", "30", "--no-decode")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 2, res.stdout
    for line in lines:  # the worker's 1 Hz load report
        assert f" tandem.stats.prefill_and_decode.{WORKER} worker_stats " in line and f"/{BLOCKS}" in line
    assert time.monotonic() - t0 < 30
    quiet = run_cli("tail", "--nats-url", url, "--no-stats", "--timeout", "1.5", "--no-decode")
    assert quiet.returncode == 0 and quiet.stdout == ""


# ------------------------------------------------------------------ without a server (fast)


def test_tail_summaries_of_every_kind() -> None:
    from bus.control_messages import Cancel
    from bus.generate_messages import GenerateRequest, StreamError, StreamFinish, StreamTokens, Usage
    from bus.prefill_messages import (
        KVDestination,
        KVMetaReply,
        KVMetaRequest,
        PrefillAccepted,
        PrefillDone,
        PrefillJob,
    )
    from bus.stats_messages import WorkerStats
    from bus.wire import encode, kind_of
    from tandem.tail import Printer, describe, format_line

    p = Printer(lambda ids: "".join(f"<{i}>" for i in ids), width=20)
    dst = KVDestination(engine="tcp", worker_id="d1", incarnation="i", block_ids=[4, 5], first_token_index=16)
    cases = [
        (GenerateRequest(request_id="r", prompt_ids=[1, 2], stream_subject="tandem.stream.g.r"),
         ["2 prompt tokens", '"<1><2>"', "-> tandem.stream.g.r"]),
        (PrefillJob(request_id="r", prompt_ids=[1, 2, 3], layout_fingerprint="f", dst=dst, reply_subject="x"),
         ["3 prompt tokens", "from token 16", "2 blocks of d1 via tcp"]),
        (PrefillAccepted(request_id="r", attempt=1, prefill_worker_id="p2"), ["taken by p2, attempt 1"]),
        (PrefillDone(request_id="r", ok=True, first_token=9, prefill_worker_id="p1", timings={"compute": 0.5}),
         ["ok by p1", 'first token 9 "<9>"', "compute=500.0ms"]),
        (PrefillDone(request_id="r", ok=False, error="boom", error_code="internal", prefill_worker_id="p1"),
         ["FAILED by p1 (internal): boom"]),
        (StreamTokens(request_id="r", seq=3, token_ids=[7, 8]), ["seq 3 [7, 8]", '"<7><8>"']),
        (StreamFinish(request_id="r", seq=4, finish_reason="length", prefill_mode="remote", prefill_worker_id="p1",
                      worker_id="d1", usage=Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=1)),
         ["seq 4 length", "5 prompt (1 cached), 2 completion", "prefill remote by p1 decode by d1"]),
        (StreamError(request_id="r", code="deadline_exceeded", message="late", status=504),
         ["504 deadline_exceeded: late"]),
        (Cancel(request_id="r", reason="client gone"), ["cancel (client gone)"]),
        (KVMetaRequest(worker_id="p1"), ["from p1"]),
        (KVMetaReply(worker_id="d1", incarnation="i9", engine="shm"), ["d1 engine shm incarnation i9"]),
        (WorkerStats(role="decode_only", worker_id="d1", running=2, max_batch=8, free_blocks=3, total_blocks=9,
                     prefix_hit_rate=0.25, prefill_workers=2),
         ["d1 (decode_only) running 2/8", "free 3/9", "hit 25%", "sees 2 prefill"]),
    ]
    for msg, needles in cases:
        kind, summary, rid = describe("tandem.x", encode(msg), None, p)
        assert kind == kind_of(type(msg))
        assert rid == getattr(msg, "request_id", None)
        for n in needles:
            assert n in summary, (kind, n, summary)
    long = Printer(lambda ids: "x" * 100, width=20).text([1])
    assert len(long) <= 24 and "…" in long
    assert describe("tandem.a", b"\x00garbage", {"Tandem-Request-Id": "h"}, p)[::2] == ("?", "h")
    assert describe("tandem.svc.w.stats", b"", None, p)[1].startswith("(empty body")
    assert Printer(None).text([1, 2], "fallback") == '"fallback"'
    line = format_line("tandem.s", "cancel", "r1", "cancel (x)", when=0.0)
    assert line.split()[1:] == ["tandem.s", "cancel", "rid=r1", "cancel", "(x)"]


def test_status_formatting() -> None:
    from bus.discovery import PoolStatus, Status, WorkerStatus, _worker_from_info
    from tandem.status import format_duration, format_table

    assert [format_duration(x) for x in (None, 5, 65, 3725, 200000)] == ["-", "5s", "1m05s", "1h02m", "2d07h"]
    info = {"name": "tandem-decode-only", "id": "X", "version": "0.1.0",
            "metadata": {"model": MODEL, "role": "decode_only", "worker_id": "d1", "started": "bad",
                         "metrics_url": "http://h:9100/metrics", "restarts": "3"},
            "endpoints": [{"name": "stats", "subject": "tandem.svc.d1.stats"}]}
    w = _worker_from_info(info)
    assert (w.role, w.worker_id, w.stats_subject, w.started) == ("decode_only", "d1", "tandem.svc.d1.stats", None)
    assert w.restarts == 3
    w2 = WorkerStatus(role="prefill_only", model=MODEL, worker_id="p1", service="tandem-prefill-only", service_id="Y",
                      running=1, queued=2, max_batch=4, free_blocks=6, total_blocks=8, prefix_hit_rate=0.5, uptime=61,
                      device="cuda:1", cpus="0-3", threads=4, host="host-a", kernels="avx2")
    w.stats_error = "TimeoutError"
    w.running, w.queued, w.max_batch, w.prefill_workers = 3, 0, 32, 0
    text = format_table(Status("nats://x", "tandem", [w, w2], [
        PoolStatus(MODEL, "generate", "S", "C", pending=3, in_flight=1), PoolStatus(MODEL, "prefill", "S2", "C2",
                                                                                    error="no stream")],
        paths=[{"from": "p1", "to": "d1", "engine": "tcp"}]))
    assert re.search(r" p1 +host-a +1/4 \+2 ", text) and "KV path p1 -> d1: tcp" in text
    assert "2 workers" in text and "(stats: TimeoutError)" in text and " cuda:1 cores 0-3 ×4 avx2 " in text
    assert "3/32 +0 (0 prefill)" in text and "1/4 +2 " in text  # a decode worker that hears no prefill worker
    assert "1/4 +2" in text and "2/8 (25%)" in text and "50%" in text and "1m01s" in text
    assert "RESTARTS" in text.splitlines()[1] and re.search(r"1m01s +0 ", text)
    assert "generate: 3 pending, 1 in flight" in text and "prefill: unavailable (no stream)" in text
    assert "no tandem worker answered" in format_table(Status("nats://x", "tandem"))
    assert Status("u", "n", [w2]).to_json()["workers"][0]["used_blocks"] == 2


def test_operations_doc_covers_the_flags() -> None:
    from tandem.cli import build_parser

    doc = (ROOT / "docs/operations.md").read_text()
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in ("status", "tail"):
        for action in sub.choices[name]._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag not in ("--help", "--connect-timeout", "--nats-url"):
                    assert f"`{flag}" in doc or f"{flag} " in doc, f"docs/operations.md does not explain {name} {flag}"


def test_tail_runs_until_ctrl_c() -> None:
    with EmbeddedNats() as srv:
        tail = Proc(tandem_cmd("tail", "--nats-url", srv.url, "--no-decode"))
        try:
            tail.wait_for("Ctrl-C to stop", timeout=60)
            time.sleep(0.3)
            assert tail.proc.poll() is None  # no count, no timeout: it keeps following
            tail.signal(signal.SIGINT)
            assert tail.wait(15) == 0
        finally:
            tail.stop()
        assert not any("Traceback" in line for line in tail.err), tail.text()
