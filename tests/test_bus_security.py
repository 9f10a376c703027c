"""`tandem up`'s embedded NATS admits only the processes of its run, each to its own subjects.

One real `tandem up` (a prefill worker, two decode workers, the gateway). Everything a stranger,
a process of another role, or a read-only watcher tries here is what issue 31 saw succeed on an
open bus: connect without credentials, read the prompts and answers, ask for a worker's transfer
metadata, and publish tokens with the next sequence numbers into another worker's answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import nats.errors
import nkeys
import pytest

from bench.cluster import MODEL, TandemUp
from bus import nats_config as natsconf
from bus.control_messages import Cancel
from bus.generate_messages import GenerateRequest, StreamMessage, StreamTokens
from bus.prefill_messages import KVMetaRequest, PrefillDone
from bus.publish import publish
from bus.stats_messages import WorkerStats
from bus.subjects import ROLE_GATEWAY, ROLE_OBSERVER, Subjects
from bus.wire import decode as decode_msg
from bus.wire import encode
from runtime.names import ROLE_DECODE_ONLY, ROLE_PREFILL_ONLY
from tests.harness.cluster import tandem_up
from tests.harness.gateway import dropped_counts
from tests.harness.native import NEEDS_NATIVE
from tests.harness.wait import read_until, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400), NEEDS_NATIVE]

S = Subjects(MODEL)
PROMPT = "Write one sentence about the sea."


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemUp]:
    # the row-invariant path: the same greedy request gives the same tokens however it is batched, so a
    # disturbed answer can equal an undisturbed one
    with tandem_up(tmp_path_factory.mktemp("secure"), "--decode", "2", "--kernels", "invariant",
                   "--stop-timeout", "10", "--worker-args", "--num-blocks 256 --local-prefill-max-tokens 0") as cluster:
        folder = run_folder(cluster)
        yield cluster
    assert not folder.exists(), "the run's credentials outlived it"


def run_folder(up: TandemUp) -> Path:
    return Path(up.info["nats_debug_seed"]).parent


class Login:
    """A nats-py connection as one process of the run (its seed file and inbox), recording the errors the
    server reports (permission violations arrive asynchronously)."""

    def __init__(self, up: TandemUp, name: str) -> None:
        self.url = up.info["nats_url"]
        self.seed = run_folder(up) / f"{name}.nk"
        self.inbox = natsconf.inbox_of(name)
        self.errors: list[str] = []
        self.nc: Any = None

    async def __aenter__(self) -> Login:
        async def on_error(e: Exception) -> None:
            self.errors.append(str(e).lower())

        self.nc = await nats.connect(self.url, nkeys_seed=str(self.seed), inbox_prefix=self.inbox,
                                     error_cb=on_error, allow_reconnect=False, connect_timeout=5)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()

    async def violations(self, n: int, timeout: float = 10.0) -> list[str]:
        """Wait until the server reported ``n`` permission violations to this connection."""
        await self.nc.flush(timeout=10)

        def found() -> list[str] | None:
            seen = [e for e in self.errors if "permissions violation" in e]
            return seen if len(seen) >= n else None

        return await asyncio.to_thread(wait_until, found, timeout, lambda: f"{n} violations, got {self.errors}")


async def none_arrives(sub: Any, sent: list[Any], wait: float = 0.5) -> None:
    """None of the ``sent`` messages reaches ``sub`` (which also hears the cluster's own traffic)."""
    forged = {encode(msg) for msg in sent}
    deadline = asyncio.get_running_loop().time() + wait
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        try:
            got = await sub.next_msg(timeout=left)
        except nats.errors.TimeoutError:
            return
        assert got.data not in forged, f"a refused message arrived on {got.subject}"


def chat(up: TandemUp, content: str = PROMPT, max_tokens: int = 24) -> dict[str, Any]:
    r = httpx.post(f"{up.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
        "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_run_folder_is_private_and_the_config_holds_no_secret(up: TandemUp) -> None:
    folder = run_folder(up)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    names = {p.name for p in folder.iterdir()}
    assert {"up.nk", "debug.nk", "prefill-1.nk", "decode-1.nk", "decode-2.nk", "nats.conf", "run.json"} <= names
    for p in folder.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    conf = (folder / "nats.conf").read_text()
    assert "password:" not in conf and not re.search(r"\bSU[A-Z2-7]{50,}", conf)  # public keys only, no seed
    for seed_file in folder.glob("*.nk"):
        public = nkeys.from_seed(bytearray(seed_file.read_bytes().strip())).public_key.decode()
        assert public in conf, seed_file.name


def test_a_stranger_is_refused(up: TandemUp, tmp_path: Path) -> None:
    async def go() -> None:
        for kw in ({}, {"user": "admin", "password": "admin"}, {"token": "x"}):
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await nats.connect(up.info["nats_url"], allow_reconnect=False, connect_timeout=5, **kw)
        stranger = tmp_path / "stranger.nk"  # a well-formed NKey the server does not know
        stranger.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(up.info["nats_url"], nkeys_seed=str(stranger), allow_reconnect=False,
                               connect_timeout=5)

    asyncio.run(go())
    assert "Paris" in chat(up, "What is the capital of France?", 8)["choices"][0]["message"]["content"]


def test_the_debug_credential_watches_and_cannot_publish(up: TandemUp) -> None:
    """It reads a whole request on tandem.> (what `nats sub` shows); every publish that would act is refused."""

    async def go() -> None:
        async with Login(up, "debug") as debug, Login(up, "up") as owner:
            watch = await debug.nc.subscribe(S.all)
            await debug.nc.flush()
            answer = asyncio.create_task(asyncio.to_thread(chat, up, PROMPT, 8))
            await read_until(watch, lambda got: {"generate_request", "stream_tokens", "stream_finish"}
                             <= {m.get("kind", "") for m in got}, 60, "a request's whole traffic")
            await answer
            spy = await owner.nc.subscribe(S.all)
            await owner.nc.flush()
            req = GenerateRequest(request_id="dbg", prompt_ids=[1, 2], stream_subject=S.stream("gw-x", "dbg"))
            sent = [(S.generate_pool, req), (S.generate_worker("decode-1"), req),
                    (S.stream("gw-x", "dbg"), StreamTokens(request_id="dbg", seq=1, token_ids=[1])),
                    (S.cancel("dbg"), Cancel(request_id="dbg")),
                    (S.prefill_done("decode-1", "dbg"), PrefillDone(request_id="dbg", ok=False)),
                    (S.stats(ROLE_DECODE_ONLY, "decode-1"), WorkerStats(role=ROLE_DECODE_ONLY, worker_id="decode-1",
                                                                       uptime=1e6))]
            for subject, msg in sent:
                await publish(debug.nc, subject, msg)
            with pytest.raises(nats.errors.Error):  # no transfer metadata for it either
                await debug.nc.request(S.kv_meta("decode-1"), encode(KVMetaRequest()), timeout=2)
            await debug.violations(7)
            await none_arrives(spy, [msg for _, msg in sent])

    asyncio.run(go())


def test_tail_and_status_log_in_as_the_debug_user(up: TandemUp) -> None:
    """`tandem status` and `tandem tail` pointed at the run's NATS (or nowhere) find its debug credential."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_NATS_")}
    status = subprocess.run([sys.executable, "-m", "tandem.cli", "status", "--json", "--wait", "2", "--nats-url",
                             up.info["nats_url"]], capture_output=True, text=True, timeout=60, env=env)
    assert status.returncode == 0, status.stderr
    workers = {w["worker_id"] for w in json.loads(status.stdout)["workers"]}
    assert workers == {"prefill-1", "decode-1", "decode-2"}
    tail = subprocess.run([sys.executable, "-m", "tandem.cli", "tail", "--no-decode", "--count", "2", "--timeout",
                           "20", "--nats-url", up.info["nats_url"]], capture_output=True, text=True, timeout=60,
                          env=env)
    assert tail.returncode == 0, tail.stderr
    assert len(re.findall(r" tandem\.stats\.", tail.stdout)) == 2, tail.stdout
    assert up.info["nats_debug_seed"] in up.output()  # the banner prints the `nats sub` line with it


def test_each_process_may_publish_and_read_only_its_own_subjects(up: TandemUp) -> None:
    """A role's credentials cannot do another role's job; the server reports each try, nothing crashes."""

    async def go() -> None:
        gw_id = next(p.stem for p in run_folder(up).glob("gw-*.nk"))
        async with Login(up, "up") as owner, Login(up, "prefill-1") as prefill, \
                Login(up, "decode-1") as decode, Login(up, gw_id) as gw:
            spy = await owner.nc.subscribe(S.all)
            await owner.nc.flush()
            req = GenerateRequest(request_id="x", prompt_ids=[1], stream_subject=S.stream(gw_id, "x"))
            tokens = StreamTokens(request_id="x", seq=1, token_ids=[1])
            sent = [
                # a prefill worker: no tokens into answers, no requests, no load report in another's name
                (prefill, S.stream(gw_id, "x"), tokens), (prefill, S.generate_pool, req),
                (prefill, S.stats(ROLE_PREFILL_ONLY, "prefill-2"),
                 WorkerStats(role=ROLE_PREFILL_ONLY, worker_id="prefill-2")),
                # a decode worker: no prefill results, no requests, not another worker's reports
                (decode, S.prefill_done("decode-2", "x"), PrefillDone(request_id="x", ok=True)),
                (decode, S.generate_pool, req),
                (decode, S.stats(ROLE_DECODE_ONLY, "decode-2"), WorkerStats(role=ROLE_DECODE_ONLY,
                                                                           worker_id="decode-2", uptime=1e6)),
                # the gateway: no tokens, no prefill jobs
                (gw, S.stream(gw_id, "x"), tokens), (gw, S.prefill_pool, Cancel(request_id="x"))]
            for who, subject, msg in sent:
                await publish(who.nc, subject, msg)
            await prefill.violations(3)
            await decode.violations(3)
            await gw.violations(2)
            await none_arrives(spy, [msg for _, _, msg in sent])
            # reading: nobody but the watcher reads everything, a gateway only its own answers, a worker only
            # its own work and replies
            await gw.nc.subscribe(S.streams_of_gateway("gw-other"))
            await gw.nc.subscribe(S.all)
            await gw.nc.subscribe("_INBOX.>")
            await decode.nc.subscribe(S.generate_worker("decode-2"))
            await decode.nc.subscribe(S.prefill_done_of_worker("decode-2"))
            await decode.nc.subscribe(f"{natsconf.inbox_of('decode-2')}.>")
            await prefill.nc.subscribe(S.kv_meta("decode-1"))
            await gw.violations(5)
            await decode.violations(6)
            await prefill.violations(4)
            subs_refused = [e for e in gw.errors if "violation for subscription" in e]
            assert len(subs_refused) == 3, gw.errors

    asyncio.run(go())
    assert "Paris" in chat(up, "What is the capital of France?", 8)["choices"][0]["message"]["content"]
    workers = httpx.get(f"{up.url}/ready", timeout=10).json()["workers"]
    assert {w["worker_id"] for w in workers} == {"prefill-1", "decode-1", "decode-2"}  # nothing crashed


def test_injected_tokens_never_reach_the_client(up: TandemUp) -> None:
    """Issue 31's attack, now: tokens with the next sequence numbers on a live answer's stream subject. A stranger
    cannot connect; a prefill worker may not publish there; another decode worker may, but names itself or
    forges the holder without its process: the gateway drops those (and counts them), and the answer is the
    undisturbed one."""
    undisturbed = chat(up)["choices"][0]["message"]["content"]
    before = dropped_counts(up.url)

    async def go() -> tuple[str, int]:
        async with Login(up, "debug") as debug, Login(up, "prefill-1") as prefill:
            streams = await debug.nc.subscribe(f"{S.namespace}.stream.>")
            await debug.nc.flush()
            answer = asyncio.create_task(asyncio.to_thread(chat, up))
            while True:  # the answer's admission notice names its decode worker and process
                msg = await streams.next_msg(timeout=60)
                first = decode_msg(msg.data, StreamMessage)
                if isinstance(first, StreamTokens):
                    break
            holder = first.worker_id
            other = "decode-2" if holder == "decode-1" else "decode-1"
            async with Login(up, other) as rogue:
                sent = 0
                for seq in range(first.seq + 1, first.seq + 40):
                    for who, incarnation in ((other, "x"), (holder, "forged")):
                        await publish(rogue.nc, msg.subject, StreamTokens(
                            request_id=first.request_id, seq=seq, token_ids=[42], text=" INJECTED",
                            worker_id=who, incarnation=incarnation))
                        sent += 1
                await publish(prefill.nc, msg.subject, StreamTokens(
                    request_id=first.request_id, seq=first.seq + 1, token_ids=[42], text=" INJECTED",
                    worker_id=holder, incarnation=first.incarnation))
                await prefill.violations(1)
                await rogue.nc.flush()
            return (await answer)["choices"][0]["message"]["content"], sent

    text, sent = asyncio.run(go())
    assert text == undisturbed and "INJECTED" not in text
    after = dropped_counts(up.url)
    dropped = sum(after.get(r, 0) - before.get(r, 0) for r in ("other_worker", "other_process"))
    assert 0 < dropped <= sent  # those that arrived while the answer streamed (the rest: after it ended)


def test_the_embedded_and_deploy_configs_come_from_one_template(up: TandemUp) -> None:
    """Each process's permissions in the run's config are its role's deploy/ permissions, narrowed to its own id
    and inbox (and reading, not creating, the streams that `tandem up` made): never wider."""
    conf = (run_folder(up) / "nats.conf").read_text()
    deploy = {u.name: u for u in natsconf.deploy_users(S)}
    for name, role, deploy_user in (("prefill-1", ROLE_PREFILL_ONLY, "prefill"), ("decode-1", ROLE_DECODE_ONLY,
                                                                                    "decode"),
                                    ("debug", ROLE_OBSERVER, "ops")):
        mine = S.permissions(role, "*" if role == ROLE_OBSERVER else name, inbox=natsconf.inbox_of(name),
                             create_streams=False)
        for subject in mine["publish"] + mine["subscribe"]:
            assert json.dumps(subject) in conf, (name, subject)
        theirs = deploy[deploy_user].permissions
        assert theirs is not None
        for verb in ("publish", "subscribe"):
            for subject in mine[verb]:
                wider = subject.replace(natsconf.inbox_of(name), natsconf.inbox_of(deploy_user))
                assert any(covers(p, wider) for p in theirs[verb]), (name, verb, subject)
    gw_id = next(p.stem for p in run_folder(up).glob("gw-*.nk"))
    gw = S.permissions(ROLE_GATEWAY, gw_id, inbox=natsconf.inbox_of(gw_id), create_streams=False)
    assert S.streams_of_gateway(gw_id) in gw["subscribe"] and json.dumps(S.streams_of_gateway(gw_id)) in conf
    assert f'"{S.namespace}.stream.*.*"' not in conf.split(f"nkey: \"{pubkey(up, gw_id)}\"")[1].split("nkey:")[0]


def pubkey(up: TandemUp, name: str) -> str:
    return nkeys.from_seed(bytearray((run_folder(up) / f"{name}.nk").read_bytes().strip())).public_key.decode()


def covers(pattern: str, subject: str) -> bool:
    """Whether NATS permission ``pattern`` allows everything ``subject`` (itself maybe a pattern) does."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]) or (tok == "*" and s[i] == ">"):
            return False
    return len(p) == len(s)
