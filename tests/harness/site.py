"""The four-machine site of the multi-host fault tests (A: member + prefill worker, B and C: member + decode
worker, D: the gateway) and how a test looks at it: through the gateway's ``/cluster`` and ``/ready``, and as
NATS's admin user."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import nats

from bench.hosts import Deployment, Hosts
from runtime.settings import read_env_file
from tests.harness.wait import wait_until

#: what the harness gives every machine besides the walk-through's own commands: the row-invariant kernel
#: path (a remote prefill then computes exactly as a local one) and one torch thread per worker (two cores here)
MACHINE_ENV = {"TANDEM_KERNELS": "invariant", "TANDEM_THREADS": "1", "TANDEM_NUM_BLOCKS": "256"}
#: every prompt goes to the prefill worker while it lives (none is short enough to stay, none stalls)
DECODE_ARGS = ("--local-prefill-max-tokens", "0", "--prefill-stall-budget-ms", "0")
GENERATE_STREAM = "TANDEM_SMOLLM2_135M_INSTRUCT_GENERATE"


class Site:
    """The emulated machines of one test, with tandem deployed on them."""

    def __init__(self, hosts: Hosts, dep: Deployment) -> None:
        self.hosts, self.dep = hosts, dep
        self.url = f"http://{hosts.ip('d')}:8000"

    def cluster(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/cluster", timeout=10).json()

    def heard(self, workers: set[str], timeout: float = 60.0) -> None:
        """Until the gateway's router has fresh load reports of ``workers`` (what routing and admission use)."""
        rows: list[Any] = []

        def fresh() -> bool:
            rows[:] = httpx.get(f"{self.url}/ready", timeout=10).json().get("workers", [])
            return workers <= {w["worker_id"] for w in rows if w["age_s"] < 2}

        wait_until(fresh, timeout, lambda: f"fresh reports of {sorted(workers)}: {rows}", interval=0.2)

    def wait_until(self, what: str, pred: Any, timeout: float = 60.0) -> float:
        """Seconds until ``pred(cluster view)`` holds (AssertionError naming ``what`` and the last view after
        ``timeout``)."""
        t0 = time.monotonic()
        last: list[Any] = [None]

        def holds() -> bool:
            last[0] = self.cluster()
            return bool(pred(last[0]))

        wait_until(holds, timeout, lambda: f"{what}; last view {last[0]}", interval=0.3,
                   ignore=(httpx.HTTPError, ValueError))
        return time.monotonic() - t0

    def idle(self, survivors: set[str]) -> None:
        """The survivors hold no block and run nothing, the queues are empty."""
        def ok(c: dict[str, Any]) -> bool:
            rows = {w["worker_id"]: w for w in c["workers"] if w["alive"]}
            return survivors <= set(rows) and all(rows[w]["used_blocks"] == 0 and rows[w]["running"] == 0
                                                  for w in survivors) \
                and all(p["pending"] == 0 and p["in_flight"] == 0 for p in c["pools"] if p["error"] is None)
        self.wait_until(f"{sorted(survivors)} idle", ok, 90)

    async def admin(self, dead: str = "") -> Any:
        values = read_env_file(self.dep.env_file)
        servers = [u for u in self.dep.urls.split(",") if not dead or self.hosts.ip(dead) not in u]
        return await nats.connect(servers=servers, user="admin", dont_randomize=True,
                                  password=values["TANDEM_NATS_PASSWORD_ADMIN"], connect_timeout=5,
                                  max_reconnect_attempts=3)

    def streams_settled(self, timeout: float = 60.0) -> None:
        """Until every JetStream stream (the work queues, the claims) has a leader and every replica is current:
        after a member's restart an election may still be due, and a worker that cannot claim a job refuses it."""
        unsettled: list[str] = []

        async def look() -> bool:
            nc = await self.admin()
            try:
                streams = await nc.jetstream().streams_info()
            finally:
                await nc.close()
            unsettled[:] = [s.config.name for s in streams if s.cluster is None or not s.cluster.leader
                            or not all(r.current for r in s.cluster.replicas or [])]
            return bool(streams) and not unsettled

        wait_until(lambda: asyncio.run(look()), timeout, lambda: f"streams settled; unsettled: {unsettled}",
                   interval=0.5, ignore=(nats.errors.Error, asyncio.TimeoutError, OSError))

    def leader(self, dead: str = "") -> str:
        """The member leading the generate queue (asked of the members but ``dead``)."""
        async def go() -> str:
            nc = await self.admin(dead)
            try:
                return (await nc.jetstream().stream_info(GENERATE_STREAM)).cluster.leader
            finally:
                await nc.close()

        return asyncio.run(go())

    def lead_from(self, name: str, timeout: float = 30.0) -> None:
        """Until member ``name`` leads the generate queue (asking the leader to step down in its favour)."""
        async def step_down() -> None:
            nc = await self.admin()
            try:
                await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{GENERATE_STREAM}",
                                 json.dumps({"placement": {"preferred": name}}).encode(), timeout=5)
            finally:
                await nc.close()

        def leads() -> bool:
            if self.leader() == name:
                return True
            asyncio.run(step_down())
            return False

        wait_until(leads, timeout, lambda: f"{name} to lead the work queue ({self.leader()} does)", interval=1.0)
