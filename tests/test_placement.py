"""runtime/placement.py: CPU lists, their split among workers, `tandem up`'s default layout, and the
one-line errors of bad lists (`tandem serve --cpus`, `tandem up --prefill-cpus`).

That a worker really runs on its cores is checked on real processes: `tandem serve --cpus` in
tests/test_status.py, `tandem up`'s default layout in tests/test_bench.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from runtime.placement import (
    WorkerPlacement,
    format_cpus,
    parse_cpus,
    parse_devices,
    plan_layout,
    split_cpus,
)
from runtime.settings import Settings

FOUR = [0, 1, 2, 3]


def describe(layout) -> tuple[list[str], list[str]]:
    return [p.describe() for p in layout.prefill], [p.describe() for p in layout.decode]


def test_cpu_lists_parse_and_format() -> None:
    assert parse_cpus("0", allowed=FOUR) == [0]
    assert parse_cpus("2-3", allowed=FOUR) == [2, 3]
    assert parse_cpus(" 3, 0-1 ,1", allowed=FOUR) == [0, 1, 3]
    assert format_cpus([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert format_cpus(parse_cpus("0,2-3", allowed=FOUR)) == "0,2-3"


@pytest.mark.parametrize("text, why", [
    ("", "'' is not a core number"),
    ("a", "'a' is not a core number or a range like 2-3"),
    ("1-", "'1-' is not a core number"),
    ("3-1", "the range 3-1 goes down; write 1-3"),
    ("1,,2", "'' is not a core number"),
    ("2-5", "cores 4-5 not available here (this process may use cores 0-3)"),
    ("9", "core 9 not available here"),
])
def test_bad_cpu_lists_say_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match="^--cpus ") as e:
        parse_cpus(text, allowed=FOUR)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_split_among_workers() -> None:
    assert split_cpus([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cpus([4, 5], 2) == [[4], [5]]
    assert split_cpus([0, 1], 3) == [[0], [1], [0]]  # more workers than cores: they take turns
    assert WorkerPlacement((0, 1), 2, "cuda:1").serve_args() == ["--cpus", "0-1", "--threads", "2",
                                                                  "--device", "cuda:1"]
    assert WorkerPlacement().serve_args() == []


LENDS = "lends them: a step every 50 ms during long prompts"


def test_default_layout_on_two_cores() -> None:
    """Disaggregated: prefill on core 0 and, at idle priority, decode's core 1; aggregated: all cores."""
    two = [0, 1]
    assert describe(plan_layout(1, 1, available=two)) == (["cores 0 + 1 while lent, 2 threads, idle priority"],
                                                          [f"cores 1, 1 thread, {LENDS}"])
    assert describe(plan_layout(0, 1, available=two)) == ([], ["cores 0-1, 2 threads"])
    assert describe(plan_layout(0, 2, available=two)) == ([], ["cores 0, 1 thread", "cores 1, 1 thread"])
    # more workers than cores: the roles still get disjoint cores
    layout = plan_layout(1, 2, available=two)  # and nothing is lent: decode workers already share their core
    assert describe(layout) == (["cores 0, 1 thread"], ["cores 1, 1 thread", "cores 1, 1 thread"])
    assert "workers of one role share them" in layout.note
    # one core: nobody is pinned, and the threads add up to the cores
    one = plan_layout(1, 1, available=[0])
    assert describe(one) == (["any core, 1 thread"], ["any core, 1 thread"]) and "share" in one.note


def test_layout_with_more_cores_and_explicit_lists() -> None:
    eight = list(range(8))
    # each prefill worker borrows its share of the decode cores
    assert describe(plan_layout(2, 2, available=eight)) == (
        ["cores 0-1 + 4-5 while lent, 4 threads, idle priority", "cores 2-3 + 6-7 while lent, 4 threads, idle priority"],
        [f"cores 4-5, 2 threads, {LENDS}", f"cores 6-7, 2 threads, {LENDS}"])
    # prefill's share rounds down
    assert describe(plan_layout(1, 1, available=[0, 1, 2])) == (["cores 0 + 1-2 while lent, 3 threads, idle priority"],
                                                                [f"cores 1-2, 2 threads, {LENDS}"])
    # fewer decode cores than prefill workers: the first borrows them, the rest keep to their own
    assert describe(plan_layout(3, 1, available=FOUR)) == (
        ["cores 0 + 3 while lent, 2 threads, idle priority", "cores 1, 1 thread", "cores 2, 1 thread"],
        [f"cores 3, 1 thread, {LENDS}"])
    # a list for one role: the other gets what is left
    assert describe(plan_layout(1, 1, prefill_cpus="3", available=FOUR)) == (
        ["cores 3, 1 thread"], ["cores 0-2, 3 threads"])
    layout = plan_layout(1, 1, decode_cpus="0-3", available=FOUR)  # nothing left: prefill shares, yielding
    assert describe(layout) == (["cores 0-3, 4 threads, idle priority"], ["cores 0-3, 4 threads"])
    assert "prefill at idle priority" in layout.note
    # GPUs: devices split round-robin, cores left alone
    gpu = plan_layout(1, 2, prefill_devices="cuda:0", decode_devices="cuda:1,cuda:2", available=FOUR)
    assert describe(gpu) == (["cuda:0, any core"], ["cuda:1, any core", "cuda:2, any core"])
    assert describe(plan_layout(1, 1, pin=False, available=FOUR)) == (["any core"], ["any core"])
    assert describe(plan_layout(1, 1, gpu=True, available=FOUR)) == (["any core"], ["any core"])


def test_prefill_sharing_decode_cores_borrows_them() -> None:
    """Prefill given the decode worker's core too: it borrows that core (at idle priority); decode lends it, pacing
    its steps while a long prompt is prefilled for it."""
    layout = plan_layout(1, 1, prefill_cpus="0,1", decode_cpus="1", available=[0, 1])
    assert describe(layout) == (["cores 0 + 1 while lent, 2 threads, idle priority"], [f"cores 1, 1 thread, {LENDS}"])
    assert layout.prefill[0].serve_args() == ["--cpus", "0", "--threads", "2", "--borrow-cpus", "1"]
    assert layout.decode[0].serve_args() == ["--cpus", "1", "--threads", "1", "--lend-step-ms", "50"]
    # disjoint lists: nobody yields
    apart = plan_layout(1, 1, prefill_cpus="0", decode_cpus="1", available=[0, 1])
    assert not apart.prefill[0].idle_priority and not apart.decode[0].idle_priority
    assert apart.decode[0].serve_args() == ["--cpus", "1", "--threads", "1"]  # nobody borrows: steps back to back


def test_idle_priority_covers_every_thread_of_the_worker() -> None:
    """`place` puts the process in SCHED_IDLE, the threads it has and those torch and the bus start later."""
    code = """
import os, threading, torch
from actors.serve import place
from runtime.settings import Settings
s = Settings.from_env(idle_priority=True, threads=2)
place(s)
torch.ones(512, 512) @ torch.ones(512, 512)  # torch's pool starts its threads now
t = threading.Thread(target=lambda: None); t.start(); t.join()
tids = [int(t) for t in os.listdir("/proc/self/task")]
print(len(tids), sorted({os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids}))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    count, flags = res.stdout.split(maxsplit=1)
    assert int(count) >= 2 and flags.strip() == "[True]"


def test_layout_refuses_bad_lists() -> None:
    with pytest.raises(ValueError, match="--prefill-cpus '7': core 7 not available"):
        plan_layout(1, 1, prefill_cpus="7", available=FOUR)
    with pytest.raises(ValueError, match="--prefill-cpus names cores for prefill workers, but there are none"):
        plan_layout(0, 1, prefill_cpus="0", available=FOUR)
    with pytest.raises(ValueError, match="--decode-devices 'gpu:1': expected cpu, cuda or cuda:N"):
        parse_devices("gpu:1", "--decode-devices")


def test_settings_check_cpus_threads_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = format_cpus(sorted(__import__("os").sched_getaffinity(0)))
    assert Settings.from_env(cpus=allowed.split(",")[0]).cpus
    with pytest.raises(ValueError, match="--cpus '0-x'"):
        Settings.from_env(cpus="0-x")
    with pytest.raises(ValueError, match="--threads must be at least 0, got -1"):
        Settings.from_env(threads=-1)
    with pytest.raises(ValueError, match="--device 'gpu': expected cpu, cuda or cuda:N"):
        Settings.from_env(device="gpu")
    first = allowed.split(",")[0].split("-")[0]
    with pytest.raises(ValueError, match="--borrow-cpus needs --cpus"):
        Settings.from_env(borrow_cpus=first)
    with pytest.raises(ValueError, match=f"--borrow-cpus '{first}' names cores of --cpus '{first}'"):
        Settings.from_env(cpus=first, borrow_cpus=first)
    monkeypatch.setenv("TANDEM_CPUS", "99999")
    with pytest.raises(ValueError, match="core 99999 not available"):
        Settings.from_env()


@pytest.mark.parametrize("argv, message", [
    (["serve", "--cpus", "1-0"], "error: --cpus '1-0': the range 1-0 goes down; write 0-1"),
    (["serve", "--cpus", "99999"], "error: --cpus '99999': core 99999 not available here"),
    (["up", "--port", "0", "--nats-port", "0", "--decode-cpus", "x"],
     "tandem up: --decode-cpus 'x': 'x' is not a core number or a range like 2-3"),
])
def test_bad_cpus_on_the_command_line_is_one_line(argv: list[str], message: str) -> None:
    res = subprocess.run([sys.executable, "-m", "tandem.cli", *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().startswith(message) and len(res.stderr.strip().splitlines()) == 1, res.stderr
