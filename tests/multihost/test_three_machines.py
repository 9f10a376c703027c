"""docs/operations.md's "three machines", run as written on three emulated machines (bench/hosts.py).

Machine A runs a NATS member and a prefill worker, B a member and a decode worker, C a member and the
gateway; the work queues keep three replicas. What crosses between them goes through the emulated
network only: KV over TCP (and over NIXL, UCX over TCP), never shared memory, which the machines do not
share. The answers must equal an aggregated worker's, token for token, and a worker of another KV layout
must be refused with both layouts named.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.hosts import Hosts, run_walkthrough, walkthrough
from bus.options import user_login
from runtime.settings import read_env_file
from tests.harness.native import NEEDS_NATIVE
from tests.harness.site import MACHINE_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), NEEDS_NATIVE]

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


class Machines:
    """The three emulated machines after the walk-through, and what its finished steps printed."""

    def __init__(self, hosts: Hosts, folder: Path, results: dict[int, Any], steps: list[tuple[str, str]]) -> None:
        self.hosts, self.folder, self.results, self.steps = hosts, folder, results, steps

    def output(self, needle: str) -> str:
        """The stdout of the finished step whose command contains ``needle``."""
        return next(self.results[i].stdout for i, (_, cmd) in enumerate(self.steps)
                    if needle in cmd and i in self.results)

    def env(self) -> dict[str, str]:
        """tandem.env, as a dict (the users' passwords, the servers)."""
        return read_env_file(self.folder / "tandem.env")

    def login(self, user: str) -> dict[str, str]:
        env = self.env()
        return {**user_login(user, env), "TANDEM_NATS_URL": env["TANDEM_NATS_URL"]}

    def serve(self, host: str, name: str, user: str, *args: str, env: dict[str, str] | None = None) -> None:
        """Another worker on ``host``, started as the walk-through starts its own."""
        child = self.hosts.tandem(host, name, "--env-file", str(self.folder / "tandem.env"), "--nats-user", user,
                                  "serve", "--worker-id", name, *args, env={**MACHINE_ENV, **(env or {})},
                                  ready_marker=f" {name} ready")
        child.wait_ready(300)

    def generate(self, worker: str, target: str | None = None, message: str = "Name three colours of the sea.",
                 max_tokens: int = 24) -> dict[str, Any]:
        """A greedy request sent on the bus straight to ``worker`` (from C, as the gateway user)."""
        cmd = [sys.executable, "-m", "bench.cluster", "generate", "--nats-url", self.env()["TANDEM_NATS_URL"],
               "--worker", worker, "--message", message, "--max-tokens", str(max_tokens)]
        if target:
            cmd += ["--target-endpoint", target]
        res = self.hosts.shell("c", " ".join(f"'{w}'" for w in cmd), self.folder, env=self.login("gateway"),
                               timeout=180)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Machines]:
    folder = tmp_path_factory.mktemp("three-machines")
    steps = walkthrough(DOC.read_text(), "three-machines")
    with Hosts(["a", "b", "c"], folder / "logs") as hosts:
        results = run_walkthrough(hosts, steps, folder, env=MACHINE_ENV)
        yield Machines(hosts, folder, results, steps)


def test_the_walkthrough_serves_across_three_machines(machines: Machines) -> None:
    answer = json.loads(machines.output("/v1/chat/completions"))
    assert "Paris" in answer["choices"][0]["message"]["content"]
    status = machines.output(" status")
    assert re.search(r"decode_only .* decode-b +host-b ", status) and re.search(r"prefill_only .* prefill-a +host-a ",
                                                                                 status), status
    assert "KV path prefill-a -> decode-b: tcp" in status, status  # the machines share no memory
    # the work queues live on all three members
    probe = ("import asyncio, json, nats\n"
             "async def go():\n"
             "    nc = await nats.connect(servers=URLS.split(','), user='admin', password=PW)\n"
             "    info = await nc.jetstream().stream_info(STREAM)\n"
             "    print(json.dumps([info.config.num_replicas, info.cluster.leader,"
             " [r.name for r in info.cluster.replicas or []]]))\n"
             "    await nc.close()\n"
             "asyncio.run(go())\n")
    env = machines.env()
    res = machines.hosts.shell("a", f"{sys.executable} -c \"$PROBE\"", machines.folder, env={
        "PROBE": probe.replace("URLS", repr(env["TANDEM_NATS_URL"])).replace("PW", repr(env["TANDEM_NATS_PASSWORD_ADMIN"]))
        .replace("STREAM", repr("TANDEM_SMOLLM2_135M_INSTRUCT_GENERATE"))})
    assert res.returncode == 0, res.stderr
    replicas, leader, followers = json.loads(res.stdout)
    assert replicas == 3 and {leader, *followers} == {"host-a", "host-b", "host-c"}, (replicas, leader, followers)


def test_greedy_answers_across_machines_equal_an_aggregated_worker(machines: Machines) -> None:
    machines.serve("c", "agg-c", "aggregate", "--pipeline-role", "prefill_and_decode")
    split = machines.generate("decode-b", target="prefill-a")
    alone = machines.generate("agg-c")
    assert split["finish"]["prefill_mode"] == "remote" and split["finish"]["kv_transfer"] == "tcp", split["finish"]
    assert split["finish"]["kv_bytes"] > 0
    assert alone["finish"]["prefill_mode"] == "aggregate"
    assert split["token_ids"] == alone["token_ids"] and len(split["token_ids"]) == 24


def test_kv_crosses_by_nixl_too(machines: Machines) -> None:
    """Two more workers with every engine (``--kv-transfer auto``): between machines they pick NIXL (UCX over TCP
    on the machines' own interfaces), never shared memory, although both offer it."""
    hosts = machines.hosts
    for host, name, user, role in (("a", "prefill-an", "prefill", "prefill_only"),
                                   ("b", "decode-bn", "decode", "decode_only")):
        machines.serve(host, name, user, "--pipeline-role", role, "--kv-transfer", "auto", "--kv-tcp-host",
                       "0.0.0.0", "--advertise-host", hosts.ip(host),
                       env={"UCX_NET_DEVICES": hosts.device(host), "UCX_TLS": "tcp"})
    nixl = machines.generate("decode-bn", target="prefill-an")
    tcp = machines.generate("decode-b", target="prefill-a")
    assert nixl["finish"]["kv_transfer"] == "nixl" and nixl["finish"]["prefill_worker_id"] == "prefill-an"
    assert nixl["token_ids"] == tcp["token_ids"]


def test_a_worker_of_another_kv_layout_is_refused_naming_both(machines: Machines) -> None:
    # bfloat16 runs torch's operations: not the invariant path the harness gives every machine
    machines.serve("b", "decode-b16", "decode", "--pipeline-role", "decode_only", "--dtype", "bfloat16",
                   "--kernels", "auto", "--kv-transfer", "tcp", "--kv-tcp-host", "0.0.0.0", "--advertise-host", machines.hosts.ip("b"))
    out = machines.generate("decode-b16", target="prefill-a")
    err = out.get("error")
    assert err is not None and err["code"] == "layout_mismatch", out
    # the default worker's cache is float16 (`--kv-dtype auto` beside the quantized weights)
    assert " bfloat16 block_size" in err["message"] and " float16 block_size" in err["message"], err["message"]
