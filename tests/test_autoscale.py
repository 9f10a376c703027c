"""Autoscaling on demand: bus/demand.py (the signal), tandem/up/autoscale.py (KEDA's rule, the cool-down)
and ``tandem up --autoscale`` under a real burst (real NATS, real workers, real HTTP).

The KEDA ScaledObjects are evaluated against a real server's /jsz in tests/test_deploy.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.cluster import TandemUp
from bus.demand import Demand, held_by, lag_from_jsz, role_demand
from bus.stats_messages import WorkerStats
from tandem.up import UpError
from tandem.up.autoscale import SCALED_ROLE, Decider, RolePolicy, parse_ranges, parse_role_numbers, policies
from tandem.up.flags import configure_parser
from tandem.up.plan import Plan, make_plan
from tests.harness.chat import long_prompt, stream_chat
from tests.harness.wait import wait_until

pytestmark = pytest.mark.timeout(400)


# ---- the signal -----------------------------------------------------------------------------


def stats(role: str, wid: str, **kw: Any) -> WorkerStats:
    return WorkerStats(role=role, worker_id=wid, **kw)


def test_demand_adds_what_the_workers_hold_to_the_pool_lag() -> None:
    reports = [
        stats("decode_only", "d1", running=5, queued=2, deferred_prefills=3),  # queued is part of running
        stats("prefill_and_decode", "a1", running=1),
        stats("prefill_only", "p1", running=2, queued=4),  # 4 targeted jobs wait in its backlog
    ]
    assert role_demand("decode", 7, reports) == Demand("decode", 7, 6)
    assert role_demand("prefill", 1, reports) == Demand("prefill", 1, 2 + 4 + 3)
    assert role_demand("prefill", 1, reports).total == 10
    assert held_by("decode", reports[2]) == 0 and held_by("prefill", reports[1]) == 0
    with pytest.raises(ValueError, match="unknown role"):
        role_demand("gateway", 0, reports)


def test_lag_from_jsz_is_pending_plus_unacknowledged_of_the_named_consumer() -> None:
    jsz = {"account_details": [
        {"name": "OTHER", "stream_detail": [{"name": "S", "consumer_detail": [
            {"name": "c", "num_pending": 100, "num_ack_pending": 100}]}]},
        {"name": "TANDEM", "stream_detail": [{"name": "S", "consumer_detail": [
            {"name": "x", "num_pending": 50}, {"name": "c", "num_pending": 3, "num_ack_pending": 2}]}]},
    ]}
    assert lag_from_jsz(jsz, "S", "c", "TANDEM") == 5
    assert lag_from_jsz(jsz, "S", "c") == 200  # the first account that has it
    assert lag_from_jsz(jsz, "S", "missing", "TANDEM") is None
    assert lag_from_jsz({}, "S", "c") is None


# ---- the rule -------------------------------------------------------------------------------


def test_keda_rule_activation_target_and_range() -> None:
    prefill = RolePolicy(min=0, max=2, target=2, activation=1)
    assert [prefill.desired(d) for d in (0, 1, 1.5, 2, 4, 5, 100)] == [0, 0, 1, 1, 2, 2, 2]
    decode = RolePolicy(min=1, max=3, target=4, activation=0)
    assert [decode.desired(d) for d in (0, 1, 4, 5, 9, 50)] == [1, 1, 1, 2, 3, 3]


def test_scale_up_at_once_scale_down_after_a_whole_cooldown_to_the_largest_want() -> None:
    d = Decider({"decode": RolePolicy(1, 4, 2, 0)}, cooldown=10)
    assert d.target("decode", 1, 1, now=0) == (1, 1)
    assert d.target("decode", 7, 1, now=1) == (4, 4)  # up: at once
    d.did_change("decode", 1)
    assert d.target("decode", 5, 4, now=2) == (3, 4)  # down: not within the cool-down
    assert d.target("decode", 1, 4, now=9) == (1, 4)
    assert d.target("decode", 1, 4, now=11.5) == (1, 3)  # 3 was wanted at t=2, within the last 10 s
    assert d.target("decode", 1, 4, now=12.5) == (1, 1)
    assert d.target("decode", 3, 1, now=13) == (2, 2)


def test_autoscale_flags_are_checked() -> None:
    assert parse_ranges("prefill=0..2,decode=1..2") == {"prefill": (0, 2), "decode": (1, 2)}
    assert parse_role_numbers("decode=4", "--autoscale-target", True) == {"decode": 4.0}
    for bad, why in (("prefill=0..2,decode=0..2", "decode needs at least 1"), ("decode=2..1", "MAX must be"),
                     ("gpu=0..1", "expected role=VALUE"), ("decode=1-2", "not a range"),
                     ("decode=1..2,decode=1..3", "named twice")):
        with pytest.raises(ValueError, match=why):
            parse_ranges(bad)
    with pytest.raises(ValueError, match="must be positive"):
        parse_role_numbers("decode=0", "--autoscale-target", True)
    assert policies({"prefill": (0, 2)}, {}, {"prefill": 3})["prefill"] == RolePolicy(0, 2, 2.0, 3.0)


def plan(*argv: str) -> Plan:
    args = configure_parser(argparse.ArgumentParser()).parse_args(["--port", "0", *argv])
    return make_plan(args, True, lambda line: None)


def test_up_starts_each_role_at_its_minimum_with_slots_placed_for_its_maximum() -> None:
    p = plan("--autoscale", "prefill=0..2,decode=1..2", "--metrics-port-base", "0")
    assert [(w, r) for w, r, _ in p.workers] == [("decode-1", "decode_only")]
    assert [(w, r) for w, r, _ in p.slots] == [("prefill-1", "prefill_only"), ("prefill-2", "prefill_only"),
                                               ("decode-1", "decode_only"), ("decode-2", "decode_only")]
    assert set(p.placements) == {w for w, _, _ in p.slots}
    assert p.autoscale_metrics_port not in {port for _, _, port in p.slots}
    for argv, why in ((["--autoscale", "decode=1..2", "--decode", "2"], "drop --prefill/--decode"),
                      (["--autoscale-target", "decode=2"], "need --autoscale"),
                      (["--autoscale", "prefill=0..1", "--aggregated"], "decode only"),
                      (["--autoscale", "decode=1..2", "--autoscale-cooldown", "0"], "must be positive")):
        with pytest.raises(UpError, match=why):
            plan(*argv)


# ---- tandem up --autoscale under a burst ------------------------------------------------------


def workers_of(up: TandemUp) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for c in up.info["children"]:
        if c["role"] in SCALED_ROLE:
            out[SCALED_ROLE[c["role"]]].append(c["name"])
    return out


def status_json(up: TandemUp) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "status", "--json", "--no-pools",
                        "--nats-url", up.info["nats_url"]], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
def test_a_burst_scales_up_and_the_scaler_drains_back_to_the_minimum_without_failing_a_request(
        tmp_path: Path) -> None:
    up = TandemUp(tmp_path, "--autoscale", "prefill=0..1,decode=1..2", "--autoscale-target", "decode=2",
                  "--autoscale-cooldown", "4", "--autoscale-interval", "0.5", "--drain-timeout", "20",
                  "--worker-args", "--threads 1 --num-blocks 256", "--gateway-args", "--max-queue-wait 240", env={"OMP_NUM_THREADS": "1"}).start(300)
    try:
        assert workers_of(up) == {"prefill": [], "decode": ["decode-1"]}  # the minimum: prefill at zero
        seen: list[dict[str, list[str]]] = []
        states: list[dict[str, Any]] = []

        async def burst() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(timeout=300) as client:
                tasks = [asyncio.create_task(stream_chat(client, up.url, long_prompt(i, 20), max_tokens=64,
                                                         ignore_eos=True)) for i in range(6)]
                while not all(t.done() for t in tasks):
                    seen.append(workers_of(up))
                    if len(seen) % 4 == 0:
                        states.append(await asyncio.to_thread(status_json, up))
                    await asyncio.sleep(0.5)
                return [t.result() for t in tasks]

        results = asyncio.run(burst())
        assert [(r["status"], r["finish"], r["error"]) for r in results] == [(200, "length", None)] * 6
        out = up.output()
        up_lines = re.findall(r"autoscale (\w+) (\d+) -> (\d+) \(demand (\d+) = lag (\d+) \+ held (\d+)", out)
        ups = {role: (int(a), int(b), int(d)) for role, a, b, d, _, _ in up_lines if int(b) > int(a)}
        assert ups.get("decode", (0, 0, 0))[:2] == (1, 2) and ups["decode"][2] > 2, out[-3000:]  # above 1 × target 2
        assert ups.get("prefill", (0, 0, 0))[:2] == (0, 1) and ups["prefill"][2] > 1, out[-3000:]  # past activation 1
        assert any(len(s["decode"]) == 2 for s in seen) and any(s["prefill"] for s in seen)
        scaled = [a for st in states for a in st["autoscale"] if a["role"] == "decode" and a["desired"] == 2]
        assert scaled, states  # tandem status shows desired/actual while it lasts

        def at_the_minimum() -> bool:
            assert up.child.running, up.output()[-3000:]
            return workers_of(up) == {"prefill": [], "decode": ["decode-1"]}

        wait_until(at_the_minimum, 150, lambda: f"the minimum again:\n{up.output()[-3000:]}", interval=0.5)
        out = up.output()
        assert "autoscale prefill 1 -> 0" in out and "autoscale decode 2 -> 1" in out
        assert "prefill-1 drained and stopped (exit code 0)" in out
        assert "decode-2 drained and stopped (exit code 0)" in out
        assert "restarting it" not in out  # a drained worker is no failure
        roles = {a["role"]: a for a in status_json(up)["autoscale"]}
        assert (roles["decode"]["actual"], roles["decode"]["desired"]) == (1, 1)
        assert (roles["prefill"]["actual"], roles["prefill"]["min"], roles["prefill"]["max"]) == (0, 0, 1)
        metrics = httpx.get(f"{up.url}/metrics", timeout=10).text
        assert re.search(r'^tandem_demand\{role="decode"\} 0\.0$', metrics, re.M), metrics
        m = httpx.get(up.info["autoscale_metrics"], timeout=10).text
        assert re.search(r'^tandem_autoscale_decisions_total\{action="up",role="decode"\} 1\.0$', m, re.M), m
        after = asyncio.run(_one(up))  # and it still serves
        assert after["status"] == 200 and after["finish"], after
    finally:
        up.stop(120)


async def _one(up: TandemUp) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await stream_chat(client, up.url, "What is the capital of France?", max_tokens=4)


def test_status_shows_desired_and_actual_per_role() -> None:
    from bus.discovery import Status
    from tandem.status import format_table

    st = Status(nats_url="nats://127.0.0.1:4222", namespace="tandem", autoscale=[
        {"scaler": "tandem-up-1", "model": "m", "role": "decode", "demand": 9, "lag": 1, "desired": 2, "actual": 1,
         "draining": 0, "min": 1, "max": 2, "last_action": "up to 2 at 13:39:20"}])
    assert ("autoscale m decode: 1 running, desired 2 (range 1..2), demand 9 (lag 1), 0 draining; "
            "last: up to 2 at 13:39:20 (tandem-up-1)") in format_table(st)
    assert st.to_json()["autoscale"][0]["desired"] == 2
