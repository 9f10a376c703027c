"""A three-node NATS cluster on loopback, the deploy/k8s configuration rendered for three local ports.

The work queues are R3. Two workers and a gateway log in with their roles' credentials and get
every member's URL. Under load, the server leading the generate stream is SIGKILLed: every
accepted request completes (the clients on it fail over to another member and ask for what it
dropped), and service continues on the other two members — the path for users who outgrow one machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from bench.cluster import MODEL, Worker
from bus import nats_config as natsconf
from bus.server import EmbeddedNats
from bus.streams import DEFAULT_GENERATE, DEFAULT_PREFILL, StreamConfigError, ensure_streams
from bus.subjects import Subjects
from runtime.processes import ChildProcess
from tandem.up.ports import free_port
from tests.harness.chat import assert_clear, stream_chat
from tests.harness.deploy import login_env, password_env
from tests.harness.wait import until, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

S = Subjects(MODEL)


@dataclasses.dataclass
class NatsCluster:
    servers: list[EmbeddedNats]

    @property
    def urls(self) -> str:
        return ",".join(s.url for s in self.servers)

    def by_name(self, name: str) -> EmbeddedNats:
        return next(s for s in self.servers if s.server_name == name)


def start_cluster(tmp: Path) -> NatsCluster:
    ports = [(free_port(), free_port(), free_port()) for _ in range(natsconf.CLUSTER_SIZE)]
    routes = tuple(cluster for _, cluster, _ in ports)
    servers = []
    for i, (client, cluster, monitor) in enumerate(ports):
        conf = tmp / f"nats-{i}.conf"
        member = natsconf.ClusterMember(client, cluster, monitor, tuple(f"nats-route://127.0.0.1:{p}" for p in routes),
                                        pid_file="")
        conf.write_text(natsconf.render_cluster(S, member))
        env = {**os.environ, **password_env(), "POD_NAME": f"nats-{i}"}
        servers.append(EmbeddedNats(port=None, config=conf, store_dir=tmp / f"store-{i}", server_name=f"nats-{i}",
                                    env=env, start_timeout=60))
    for srv in servers:
        srv.start()
    return NatsCluster(servers)


async def ensure_r3(urls: str, timeout: float = 120.0) -> None:
    """Create the streams with three replicas as the admin user, retrying until JetStream has a quorum."""
    nc = await nats.connect(urls.split(","), user="admin", password="pw-admin")

    async def replicated() -> bool:
        await ensure_streams(nc, S, dataclasses.replace(DEFAULT_GENERATE, replicas=3),
                             dataclasses.replace(DEFAULT_PREFILL, replicas=3), timeout=10)
        info = await nc.jetstream().stream_info(S.generate_stream)
        return info.config.num_replicas == 3 and bool(info.cluster and info.cluster.leader)

    try:
        await until(replicated, timeout, "a JetStream quorum for streams of three replicas", interval=1.0,
                    ignore=(StreamConfigError, nats.errors.Error, asyncio.TimeoutError))
    finally:
        await nc.close()


async def stream_leader(urls: str) -> str:
    nc = await nats.connect(urls.split(","), user="admin", password="pw-admin")
    try:
        return (await nc.jetstream().stream_info(S.generate_stream)).cluster.leader
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsCluster, str]]:
    tmp = tmp_path_factory.mktemp("nats3")
    nc = start_cluster(tmp)
    children: list[Any] = []
    try:
        asyncio.run(ensure_r3(nc.urls))
        creds = login_env("aggregate")
        workers = [Worker("prefill_and_decode", f"a{i}", nc.urls, tmp, "--num-blocks", "256", env=creds)
                   for i in (1, 2)]
        children += [w.child for w in workers]
        port = free_port()
        gateway = ChildProcess("gateway", [sys.executable, "-m", "tandem.cli", "gateway", "--nats-url", nc.urls,
                                           "--port", str(port)],
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **login_env("gateway")},
                               ready_marker="tandem gateway ready")
        gateway.start()
        children.append(gateway)
        for w in workers:
            w.wait_ready(300)
        gateway.wait_ready(120)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: len([w for w in httpx.get(f"{url}/ready").json()["workers"] if w["age_s"] < 3]) >= 2,
                   60, lambda: f"both workers reporting: {httpx.get(f'{url}/ready').text}", interval=0.25)
        yield nc, url
    finally:
        for c in children:
            c.stop(30)
        for srv in nc.servers:
            srv.stop()


def test_the_generate_streams_leader_dies_under_load(cluster: tuple[NatsCluster, str]) -> None:
    nats3, url = cluster
    leader = asyncio.run(stream_leader(nats3.urls))

    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [asyncio.create_task(stream_chat(client, url, f"Write a short poem number {i}.", max_tokens=120,
                                                     ignore_eos=True)) for i in range(8)]
            await asyncio.to_thread(
                wait_until, lambda: any(w["running"] for w in httpx.get(f"{url}/ready").json()["workers"]), 120,
                "a worker running the streams", 0.1)
            os.kill(nats3.by_name(leader).pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(go())
    assert_clear(results)
    # a member lost loses no stream: clients on it fail over, and what it dropped is published again
    assert all(r["status"] == 200 and r["finish"] == "length" for r in results), results
    # service continues on the other two: a new leader, and new requests are served
    survivors = NatsCluster([s for s in nats3.servers if s.server_name != leader])

    def new_leader() -> str | None:
        now = asyncio.run(stream_leader(survivors.urls))
        return now if now and now != leader else None

    wait_until(new_leader, 90, "a new stream leader", interval=1.0,
               ignore=(nats.errors.Error, asyncio.TimeoutError, AttributeError))

    async def after() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=120) as client:
            out: list[dict[str, Any]] = []

            async def four_answered() -> bool:  # a refusal (503, an error event) is tried again
                r = await stream_chat(client, url, "What is the capital of France?", max_tokens=4)
                if r["status"] == 200 and r["finish"]:
                    out.append(r)
                else:
                    assert r["status"] == 503 or r["error"], r
                return len(out) == 4

            await until(four_answered, 60, lambda: f"four answers (had {len(out)})", interval=0.5)
            return out

    assert len(asyncio.run(after())) == 4

    def nothing_held() -> bool:  # on either worker
        workers = httpx.get(f"{url}/ready").json()["workers"]
        return len(workers) == 2 and all(w["running"] == 0 and w["free_blocks"] == w["total_blocks"] for w in workers)

    wait_until(nothing_held, 60, lambda: f"every block free: {httpx.get(f'{url}/ready').json()['workers']}",
               interval=0.5)
