"""bus/: embedded nats-server, connection + auth, subjects, messages, payload limit, streams.

Everything runs against a real ``nats-server`` started by EmbeddedNats; no mocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.micro
import pytest
from nats.js import api
from nats.js.errors import NoStreamResponseError

from bus.connection import backoff_delay, connect, pick_server
from bus.control_messages import Cancel, Claim, Replay
from bus.generate_messages import GenerateRequest, StreamError, StreamFinish, StreamTokens, Timings, Usage
from bus.messages import MESSAGE_TYPES, decode_any
from bus.options import BusConnectError, BusOptions, redact_url
from bus.prefill_messages import (
    KVDestination,
    KVMetaReply,
    KVMetaRequest,
    PrefillAccepted,
    PrefillDone,
    PrefillJob,
)
from bus.publish import ServiceError, js_publish, publish, request
from bus.server import GO_THREADS, EmbeddedNats, NatsServerError, find_nats_server
from bus.stats_messages import AutoscaleState, RoleScale, WorkerStats
from bus.streams import (
    StreamConfigError,
    WorkQueueConfig,
    ensure_streams,
    fetch_one,
    pool_backlog,
    pull_subscription,
)
from bus.subjects import GENERATE_CONSUMER, PREFILL_CONSUMER, ROLE_GATEWAY, Subjects, model_token, safe_token
from bus.wire import (
    REQUEST_ID_HEADER,
    SCHEMA_VERSION,
    ErrorCode,
    MessageError,
    PayloadTooLarge,
    check_payload,
    decode,
    encode,
    kind_of,
    request_id_of,
)
from engine.params import SamplingParams
from runtime.names import ROLE_DECODE_ONLY, ROLE_PREFILL_ONLY, check_token
from tests.harness.wait import wait_until

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]


def run(coro: Awaitable[T], timeout: float = 20.0) -> T:
    """Run a coroutine with a hard deadline (no test may hang)."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def assert_round_trip(nc: Any) -> None:
    """The connection works: a message it publishes comes back to its own subscription."""
    sub = await nc.subscribe("tandem.round-trip")
    await nc.publish("tandem.round-trip", b"{}")
    assert (await sub.next_msg(timeout=10)).data == b"{}"
    await sub.unsubscribe()


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as srv:
        yield srv


def fast(url: str, **kw: Any) -> BusOptions:
    # a connection that should work gets a generous deadline; tests of failing ones pass their own
    return BusOptions(servers=(url,), connect_timeout=kw.pop("connect_timeout", 15.0), **kw)


# ---------------------------------------------------------------------------------------
# Embedded server
# ---------------------------------------------------------------------------------------


def test_find_binary() -> None:
    assert os.access(find_nats_server(), os.X_OK)


def test_start_stop_free_port_and_store(tmp_path: Path) -> None:
    store = tmp_path / "js"
    srv = EmbeddedNats(port=0, store_dir=store)
    with srv:
        assert srv.running and srv.port > 0
        assert srv.url == f"nats://127.0.0.1:{srv.port}"
        pid = srv.pid

        async def use() -> None:
            nc = await nats.connect(srv.url)
            js = nc.jetstream()
            info = await js.account_info()  # JetStream is on
            assert info.limits is not None
            await nc.close()

        run(use())
    assert not srv.running and srv.pid is None
    assert store.exists()  # a given store dir is kept
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the process is gone (reaped)


def test_the_server_runs_one_go_thread_unless_its_environment_names_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """GOMAXPROCS=1 (GO_THREADS): Go's idle threads spin for work, on cores the workers' threads fill."""
    def go_threads(**kw: Any) -> str:
        with EmbeddedNats(**kw) as srv:
            env = Path(f"/proc/{srv.pid}/environ").read_bytes().split(b"\0")
        return next(v.decode().split("=", 1)[1] for v in env if v.startswith(b"GOMAXPROCS="))

    monkeypatch.delenv("GOMAXPROCS", raising=False)
    assert go_threads() == GO_THREADS == "1"
    monkeypatch.setenv("GOMAXPROCS", "3")
    assert go_threads() == "3"
    assert go_threads(env={"PATH": os.environ["PATH"], "GOMAXPROCS": "2"}) == "2"


def test_temp_store_removed_and_async_context() -> None:
    async def go() -> str:
        async with EmbeddedNats() as srv:
            store = srv.store_dir
            assert store is not None and Path(store).is_dir()
            nc = await nats.connect(srv.url)
            await nc.close()
        return store

    store = run(go())
    assert not Path(store).exists()


def test_bad_config_reports_log_tail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.conf"
    bad.write_text("port: {{{ not a config\n")
    srv = EmbeddedNats(config=bad, start_timeout=15)
    with pytest.raises(NatsServerError) as ei:
        srv.start()
    msg = str(ei.value)
    assert "exited with code" in msg and "last log lines" in msg
    assert "bad.conf" in msg or "parse" in msg.lower()
    assert not srv.running


def test_port_in_use_is_clear(server: EmbeddedNats) -> None:
    clash = EmbeddedNats(port=server.port, start_timeout=15)
    with pytest.raises(NatsServerError, match="exited with code"):
        clash.start()
    assert not clash.running


def test_main_runs_until_interrupt(tmp_path: Path) -> None:
    code = "import sys; from bus.nats_command import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--port", "0", "--store-dir", str(tmp_path / "st")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        # as from a terminal: pytest run in the background (`cmd &`) has SIGINT ignored, and so would the child
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until ready; pytest-timeout bounds it
        assert "nats-server ready at nats://127.0.0.1:" in line
        url = line.split(" at ", 1)[1].split(" ", 1)[0]

        async def ping() -> None:
            nc = await nats.connect(url)
            await nc.flush(timeout=10)
            await nc.close()

        run(ping())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    assert (tmp_path / "st" / "jetstream").is_dir()


# ---------------------------------------------------------------------------------------
# Connection: options, auth, reconnect
# ---------------------------------------------------------------------------------------


def test_options_from_env() -> None:
    env = {
        "TANDEM_NATS_URL": "nats://a:4222, nats://b:4223",
        "TANDEM_NATS_USER": "u",
        "TANDEM_NATS_PASSWORD": "pw-secret-1",
        "TANDEM_NATS_TOKEN": "",
        "TANDEM_NATS_CREDS": "/x.creds",
        "TANDEM_NATS_NKEY_SEED": "/seed.nk",
        "TANDEM_NATS_TLS_CA": "/ca.pem",
        "TANDEM_NATS_TLS_CERT": "/c.pem",
        "TANDEM_NATS_TLS_KEY": "/k.pem",
    }
    o = BusOptions.from_env(env)
    assert o.servers == ("nats://a:4222", "nats://b:4223")
    assert (o.user, o.password, o.token) == ("u", "pw-secret-1", None)
    assert (o.creds, o.nkey_seed) == ("/x.creds", "/seed.nk")
    assert (o.tls_ca, o.tls_cert, o.tls_key) == ("/ca.pem", "/c.pem", "/k.pem")
    assert "pw-secret-1" not in repr(o)  # secrets stay out of logs
    assert BusOptions.from_env({}).servers == ("nats://127.0.0.1:4222",)
    assert BusOptions.from_env({}, servers="nats://x:1,nats://y:2").servers == ("nats://x:1", "nats://y:2")
    assert redact_url("nats://bob:hunter2@h:4222") == "nats://bob:***@h:4222"
    with pytest.raises(ValueError):
        BusOptions(servers=())


def test_inbox_prefix_and_unauthenticated_remote_servers() -> None:
    """Replies arrive under TANDEM_NATS_INBOX_PREFIX (what a locked-down server lets the user read); a server off
    this machine reached without any credential is named, so the process can say so."""
    o = BusOptions.from_env({"TANDEM_NATS_INBOX_PREFIX": "_INBOX_decode"})
    assert o.inbox_prefix == "_INBOX_decode" and o.connect_kwargs()["inbox_prefix"] == "_INBOX_decode"
    assert BusOptions.from_env({}).inbox_prefix == "_INBOX"
    with pytest.raises(ValueError, match="TANDEM_NATS_INBOX_PREFIX"):
        BusOptions.from_env({"TANDEM_NATS_INBOX_PREFIX": "_INBOX.x"})
    remote = BusOptions(servers=("nats://127.0.0.1:4222", "nats://[::1]:4222", "nats://localhost:1",
                                 "nats://10.9.8.7:4222", "tls://nats.example:4222"))
    assert remote.unauthenticated_remote() == ["nats://10.9.8.7:4222", "tls://nats.example:4222"]
    assert BusOptions(servers=("nats://127.0.0.1:4222",)).unauthenticated_remote() == []
    for cred in ({"user": "u"}, {"token": "t"}, {"nkey_seed": "/s.nk"}, {"creds": "/c.creds"}):
        assert BusOptions(servers=("nats://10.9.8.7:4222",), **cred).unauthenticated_remote() == []


def test_an_open_remote_server_is_named_at_start(tmp_path: Path) -> None:
    """`tandem status` pointed at a server by a name (which may resolve anywhere) with no credential says so."""
    import socket

    with EmbeddedNats(host="0.0.0.0") as srv:
        url = f"nats://{socket.gethostname()}:{srv.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_NATS_")}
        res = subprocess.run([sys.executable, "-m", "tandem.cli", "status", "--json", "--nats-url", url,
                              "--timeout", "10", "--wait", "0.2"], capture_output=True, text=True, timeout=60,
                             env={**env, "TANDEM_CACHE_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    assert f"connecting to {url} without credentials" in res.stderr
    assert "docs/operations.md" in res.stderr


def test_backoff_grows_and_caps() -> None:
    waits = [backoff_delay(i, 0.1, 5.0) for i in range(12)]
    assert 0.08 <= waits[0] <= 0.12
    assert waits[5] > waits[1]
    assert max(waits) <= 6.0


def test_reconnect_tries_the_other_members_before_the_lost_one() -> None:
    from urllib.parse import urlsplit

    from nats.aio.client import Server

    pool = [Server(uri=urlsplit(f"nats://10.0.0.{i}:4222")) for i in (1, 2, 3)]
    for s in pool[1:]:
        s.reconnects = 5  # failures of an earlier outage do not count in this one
    lost, failures = "10.0.0.1:4222", {}
    assert pick_server(pool, lost, failures).uri.netloc == "10.0.0.2:4222"  # the first other, in the given order
    failures["10.0.0.2:4222"] = 1  # tried and failed: the third, then the lost one, then round again
    assert pick_server(pool, lost, failures).uri.netloc == "10.0.0.3:4222"
    failures["10.0.0.3:4222"] = 1
    assert pick_server(pool, lost, failures).uri.netloc == "10.0.0.1:4222"
    failures["10.0.0.1:4222"] = 1
    assert pick_server(pool, lost, failures).uri.netloc == "10.0.0.2:4222"
    # a silent member is given up within ~3 s of pings; a member back after an outage is tried within ~1 s
    opts = BusOptions()
    assert opts.ping_interval * (opts.max_outstanding_pings + 1) <= 3.0
    assert opts.reconnect_wait_max <= 1.0 and opts.attempt_timeout <= 2.0
    assert BusOptions.from_env({"TANDEM_NATS_PING_INTERVAL": "0.5"}).ping_interval == 0.5
    with pytest.raises(ValueError, match="TANDEM_NATS_PING_INTERVAL"):
        BusOptions.from_env({"TANDEM_NATS_PING_INTERVAL": "0"})


def test_sent_log_keeps_a_key_until_a_while_after_its_end() -> None:
    from bus.replay import SentLog

    now = [100.0]
    log = SentLog(keep_s=60.0, max_keys=3, max_messages=4, clock=lambda: now[0])
    for seq in range(3):
        log.record("r1", "tandem.stream.g.r1", seq, f"m{seq}".encode(), {"h": "1"})
    assert log.since("r1", 1) == ([("tandem.stream.g.r1", b"m1", {"h": "1"}), ("tandem.stream.g.r1", b"m2", {"h": "1"})],
                                  True)
    assert log.since("r1", 3) == ([], True)
    assert log.since("nobody", 0) is None
    for seq in range(3, 6):  # over max_messages: the oldest go, and a receiver asking for them is told
        log.record("r1", "s", seq, b"x")
    kept, whole = log.since("r1", 0)
    assert len(kept) == 4 and not whole
    assert log.since("r1", 2)[1]
    log.record("r1", "s", 6, b"end", end=True)
    now[0] += 59.0
    assert "r1" in log and log.since("r1", 6) == ([("s", b"end", None)], True)
    now[0] += 2.0
    log.record("r2", "s", 0, b"y")  # looks at the expired keys (at most once a second)
    assert "r1" not in log
    log.record("r3", "s", 0, b"z", end=True)
    log.record("r4", "s", 0, b"z")
    log.record("r5", "s", 0, b"z")  # over max_keys: a key that ended goes first, though r2 is older
    assert "r3" not in log and {"r2", "r4", "r5"} == {k for k in ("r2", "r4", "r5") if k in log}
    log.record("r6", "s", 0, b"z")  # no ended key left: the least recently used open one
    assert "r2" not in log and len(log) == 3
    small = SentLog(max_bytes=10)
    small.record("a", "s", 0, b"12345678")
    small.record("b", "s", 0, b"12345678")  # over max_bytes: the oldest goes
    assert "a" not in small and "b" in small


AUTH_CONF = """
authorization {
  users = [
    {user: "alice", password: "wonderland"}
  ]
}
"""
TOKEN_CONF = 'authorization { token: "s3cr3t-token" }\n'


def test_token_auth(tmp_path: Path) -> None:
    conf = tmp_path / "token.conf"
    conf.write_text(TOKEN_CONF)
    with EmbeddedNats(config=conf) as srv:

        async def go() -> None:
            nc = await connect(fast(srv.url, token="s3cr3t-token"), "t-ok")
            assert nc.is_connected
            await nc.close()
            t0 = time.monotonic()
            with pytest.raises(BusConnectError, match="refused"):
                await connect(fast(srv.url, token="wrong", connect_timeout=20), "t-bad")
            assert time.monotonic() - t0 < 12  # an auth failure does not wait for the 20 s deadline
            with pytest.raises(BusConnectError):
                await connect(fast(srv.url, connect_timeout=10), "t-none")

        run(go(), 45)


def test_user_password_auth(tmp_path: Path) -> None:
    conf = tmp_path / "users.conf"
    conf.write_text(AUTH_CONF)
    with EmbeddedNats(config=conf) as srv:

        async def go() -> None:
            nc = await connect(fast(srv.url, user="alice", password="wonderland"), "u-ok")
            await assert_round_trip(nc)
            await nc.close()
            with pytest.raises(BusConnectError, match="refused") as ei:
                await connect(fast(srv.url, user="alice", password="nope"), "u-bad")
            assert "nope" not in str(ei.value)

        run(go())


def _nkey_seed_file(path: Path) -> str:
    """A fresh user NKey: writes its seed to `path`, returns its public key."""
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    path.write_bytes(seed)
    return nkeys.from_seed(bytearray(seed)).public_key.decode()


def test_nkey_auth(tmp_path: Path) -> None:
    allowed = _nkey_seed_file(tmp_path / "user.nk")
    _nkey_seed_file(tmp_path / "stranger.nk")
    conf = tmp_path / "nkey.conf"
    conf.write_text(f'authorization {{ users = [ {{ nkey: "{allowed}" }} ] }}\n')
    with EmbeddedNats(config=conf) as srv:

        async def go() -> None:
            nc = await connect(fast(srv.url, nkey_seed=str(tmp_path / "user.nk")), "nk-ok")
            await assert_round_trip(nc)
            await nc.close()
            with pytest.raises(BusConnectError, match="refused"):
                await connect(fast(srv.url, nkey_seed=str(tmp_path / "stranger.nk"), connect_timeout=10), "nk-bad")

        run(go())


def _nkey_pair(prefix: int) -> Any:
    import nkeys

    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def _jwt(issuer: Any, subject: str, name: str, nats_claims: dict[str, Any]) -> str:
    """A NATS JWT (v2) signed by ``issuer``: what `nsc` writes, minted here without it."""
    import base64
    import hashlib

    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    claims: dict[str, Any] = {
        "iat": int(time.time()),
        "iss": issuer.public_key.decode(),
        "name": name,
        "sub": subject,
        "nats": {**nats_claims, "version": 2},
    }
    body = json.dumps(claims, separators=(",", ":")).encode()
    claims["jti"] = base64.b32encode(hashlib.new("sha512_256", body).digest()).rstrip(b"=").decode()
    signing_input = b64(b'{"typ":"JWT","alg":"ed25519-nkey"}') + "." + b64(json.dumps(claims).encode())
    return signing_input + "." + b64(issuer.sign(signing_input.encode()))


def _creds_file(path: Path, account: Any, name: str) -> None:
    """A ``.creds`` file (user JWT + user seed) for a user of ``account``."""
    import nkeys

    user = _nkey_pair(nkeys.PREFIX_BYTE_USER)
    jwt = _jwt(account, user.public_key.decode(), name,
               {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1})
    path.write_text(
        f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n"
    )


def test_creds_auth(tmp_path: Path) -> None:
    """Decentralized (JWT) auth: an operator, a preloaded account, users from `.creds` files."""
    import nkeys

    operator = _nkey_pair(nkeys.PREFIX_BYTE_OPERATOR)
    account = _nkey_pair(nkeys.PREFIX_BYTE_ACCOUNT)
    unknown_account = _nkey_pair(nkeys.PREFIX_BYTE_ACCOUNT)
    system = _nkey_pair(nkeys.PREFIX_BYTE_ACCOUNT)  # JetStream needs a system account
    op_pub, acc_pub, sys_pub = (k.public_key.decode() for k in (operator, account, system))
    limits = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
              "conn": -1, "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    conf = tmp_path / "operator.conf"
    conf.write_text(
        f"operator: {_jwt(operator, op_pub, 'tandem-op', {'type': 'operator'})}\n"
        f"system_account: {sys_pub}\nresolver: MEMORY\nresolver_preload: {{\n"
        f"  {acc_pub}: {_jwt(operator, acc_pub, 'tandem', {'type': 'account', 'limits': limits})}\n"
        f"  {sys_pub}: {_jwt(operator, sys_pub, 'SYS', {'type': 'account'})}\n}}\n"
    )
    _creds_file(tmp_path / "worker.creds", account, "worker")
    _creds_file(tmp_path / "stranger.creds", unknown_account, "stranger")
    with EmbeddedNats(config=conf) as srv:

        async def go() -> None:
            nc = await connect(fast(srv.url, creds=str(tmp_path / "worker.creds")), "creds-ok")
            await assert_round_trip(nc)
            await ensure_streams(nc.jetstream(), Subjects(model="m"))  # the account has JetStream
            await nc.close()
            with pytest.raises(BusConnectError, match="refused"):
                await connect(fast(srv.url, creds=str(tmp_path / "stranger.creds"), connect_timeout=10), "creds-bad")

        run(go())

    with pytest.raises(BusConnectError, match="creds"):  # a missing file is named before connecting
        run(connect(fast("nats://127.0.0.1:1", creds=str(tmp_path / "absent.creds")), "creds-missing"))


def test_no_server_fails_within_deadline() -> None:
    async def go() -> None:
        t0 = time.monotonic()
        with pytest.raises(BusConnectError, match="no NATS server reachable"):
            await connect(fast("nats://127.0.0.1:1", connect_timeout=1.0), "nobody")
        assert time.monotonic() - t0 < 8  # the 1 s deadline holds (no retrying forever)

    run(go())


def test_reconnect_after_restart(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tandem.bus")
    with EmbeddedNats() as srv:

        async def go() -> None:
            events: list[str] = []

            async def on_disc() -> None:
                events.append("down")

            async def on_rec() -> None:
                events.append("up")

            opts = fast(srv.url, reconnect_wait_min=0.05, reconnect_wait_max=0.5)
            nc = await connect(opts, "restarter", on_disconnect=on_disc, on_reconnect=on_rec)
            sub = await nc.subscribe("tandem.ping")
            await srv.arestart()  # same port, same store
            await asyncio.to_thread(wait_until, lambda: "up" in events and nc.is_connected, 10, "reconnect", 0.02)
            await nc.publish("tandem.ping", b"after")  # subscription replayed on reconnect
            assert (await sub.next_msg(timeout=10)).data == b"after"
            assert events[:2] == ["down", "up"]
            await nc.close()

        run(go())
    text = caplog.text
    assert "restarter: disconnected from nats://127.0.0.1:" in text
    assert "restarter: reconnected to nats://127.0.0.1:" in text
    assert sum("reconnected to" in r.getMessage() for r in caplog.records) == 1  # one line per event


# ---------------------------------------------------------------------------------------
# Subjects
# ---------------------------------------------------------------------------------------


def test_safe_token() -> None:
    assert safe_token("SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    assert safe_token("HuggingFaceTB/SmolLM2 135M.Q4_1.gguf") == "huggingfacetb-smollm2-135m-q4_1-gguf"
    assert safe_token("a.*>b c\td") == "a-b-c-d"
    for bad in ("", "   "):
        with pytest.raises(ValueError):
            safe_token(bad)
    long = safe_token("x" * 200)
    assert len(long) <= 64 and long != safe_token("x" * 201)
    assert safe_token("***").startswith("x-")
    for name in ("a.b", "m*", "q>", "sp ace", "UPPER/lower:1"):
        t = safe_token(name)
        assert not any(c in t for c in ".*> \t")
    assert model_token("stream") == "m-stream"  # cannot collide with tandem.stream.…


def test_subject_strings() -> None:
    s = Subjects(model="SmolLM2-135M-Instruct")
    assert s.generate_pool == "tandem.smollm2-135m-instruct.generate"
    assert s.prefill_pool == "tandem.smollm2-135m-instruct.prefill"
    assert s.generate_worker("d1") == "tandem.smollm2-135m-instruct.generate.d1"
    assert s.prefill_worker("p1") == "tandem.smollm2-135m-instruct.prefill.p1"
    assert s.stream("gw1", "r1") == "tandem.stream.gw1.r1"
    assert s.prefill_done("d1", "r1") == "tandem.prefill.done.d1.r1"
    assert s.cancel("r1") == "tandem.cancel.r1"
    assert s.kv_meta("p1") == "tandem.kv.meta.p1"
    assert s.stats("prefill_only", "p1") == "tandem.stats.prefill_only.p1"
    assert s.generate_stream == "TANDEM_SMOLLM2_135M_INSTRUCT_GENERATE"
    assert s.prefill_stream == "TANDEM_SMOLLM2_135M_INSTRUCT_PREFILL"
    assert (s.generate_consumer, s.prefill_consumer) == (GENERATE_CONSUMER, PREFILL_CONSUMER)
    assert s.all == "tandem.>" and s.streams_of_gateway("gw1") == "tandem.stream.gw1.*"
    o = Subjects(model="m", namespace="prod")
    assert o.generate_pool == "prod.m.generate" and o.generate_stream == "PROD_M_GENERATE"
    assert o.cancel("r") == "prod.cancel.r"
    with pytest.raises(ValueError, match="not a subject token"):
        s.stream("gw1", "bad.id")
    with pytest.raises(ValueError):
        check_token("", "request id")
    with pytest.raises(ValueError):
        Subjects(model="m", namespace="a.b")


def test_permissions_shape() -> None:
    s = Subjects(model="m")
    p = s.permissions(ROLE_PREFILL_ONLY, "p1")
    assert "tandem.m.prefill.p1" in p["subscribe"]
    assert "tandem.prefill.done.*.*" in p["publish"]
    assert f"$JS.API.CONSUMER.MSG.NEXT.{s.prefill_stream}.{PREFILL_CONSUMER}" in p["publish"]
    assert s.generate_pool not in p["publish"]  # a prefill worker never enqueues requests
    d = s.permissions(ROLE_DECODE_ONLY)
    assert s.prefill_pool in d["publish"] and "tandem.prefill.done.*.*" in d["subscribe"]
    g = s.permissions(ROLE_GATEWAY, "gw1")
    assert "tandem.stream.gw1.*" in g["subscribe"] and s.generate_pool in g["publish"]
    with pytest.raises(ValueError):
        s.permissions("nobody")


# ---------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------


def sample_messages() -> list[msgspec.Struct]:
    sp = SamplingParams(
        max_tokens=32,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=7,
        stop=["\n\n"],
        stop_token_ids=[2],
        frequency_penalty=0.1,
        presence_penalty=0.2,
        logprobs=True,
        top_logprobs=3,
        ignore_eos=False,
    )
    dst = KVDestination(
        engine="shm",
        worker_id="d1",
        incarnation="i1",
        block_ids=[3, 4, 5],
        first_token_index=32,
        endpoint="/tandem-d1",
    )
    return [
        GenerateRequest(
            request_id="r1",
            prompt_ids=[1, 2, 3],
            sampling=sp,
            stream_subject="tandem.stream.g.r1",
            gateway_id="g",
            deadline=time.time() + 60,
            target_endpoint="p1",
            model="smollm2",
        ),
        PrefillJob(
            request_id="r1",
            prompt_ids=[1, 2, 3],
            sampling=sp,
            layout_fingerprint="abc123",
            layout={"block_size": 16, "dtype": "float32", "layers": 30},
            dst=dst,
            reply_subject="tandem.prefill.done.d1.r1",
            deadline=time.time() + 30,
            decode_worker_id="d1",
            attempt=1,
        ),
        PrefillAccepted(request_id="r1", attempt=1, prefill_worker_id="p1"),
        PrefillDone(
            request_id="r1",
            ok=True,
            first_token=42,
            first_logprob=-0.5,
            first_top_logprobs=[(42, -0.5), (7, -1.25)],
            timings={"compute": 0.1, "transfer": 0.02},
            prefill_worker_id="p1",
            cached_tokens=16,
        ),
        PrefillDone(
            request_id="r1", ok=False, error="layout mismatch: a vs b", error_code=ErrorCode.LAYOUT_MISMATCH
        ),
        StreamTokens(
            request_id="r1",
            seq=0,
            token_ids=[42, 43],
            text="Hi there",
            logprobs=[-0.5, -0.1],
            top_logprobs=[[(42, -0.5)], [(43, -0.1)]],
        ),
        StreamFinish(
            request_id="r1",
            seq=1,
            finish_reason="stop",
            usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
            timings=Timings(queue=0.001, prefill=0.1, transfer=0.02, decode=0.3),
            prefill_mode="remote",
            prefill_worker_id="p1",
            worker_id="d1",
            incarnation="i1",
        ),
        StreamError(
            request_id="r1", seq=2, code=ErrorCode.DEADLINE_EXCEEDED, message="too slow", status=504
        ),
        Cancel(request_id="r1", reason="client disconnected"),
        Claim(key="GenerateRequest:r1", request_id="r1", worker_id="d1"),
        Replay(key="r1", from_seq=3, requester="gw1"),
        KVMetaRequest(worker_id="d1", engine="nixl"),
        KVMetaReply(
            worker_id="p1",
            incarnation="i9",
            engine="nixl",
            meta={"agent": "p1", "n": 3},
            blob=bytes(range(256)),
        ),
        WorkerStats(
            role="decode_only",
            worker_id="d1",
            model="smollm2",
            running=3,
            queued=1,
            free_blocks=100,
            total_blocks=128,
            prefix_hit_rate=0.5,
            uptime=12.5,
            incarnation="i1",
            max_batch=32,
            deferred_prefills=2,
        ),
        AutoscaleState(scaler="up-1", model="smollm2", roles=[
            RoleScale(role="decode", demand=9, lag=1, desired=2, actual=1, min=1, max=2, last_action="up")]),
    ]


def test_every_message_round_trips() -> None:
    samples = sample_messages()
    assert {type(x) for x in samples} == set(MESSAGE_TYPES)  # every type covered
    for msg in samples:
        data = encode(msg)
        obj = json.loads(data)
        assert obj["kind"] == kind_of(type(msg)) and obj["v"] == SCHEMA_VERSION
        assert decode(data, type(msg)) == msg
        assert decode_any(data) == msg


def test_decode_errors_are_clear() -> None:
    with pytest.raises(MessageError, match="cannot decode GenerateRequest.*stream_subject"):
        decode(b'{"request_id": "r"}', GenerateRequest)
    with pytest.raises(MessageError, match="cannot decode StreamTokens"):
        decode(b"{not json", StreamTokens)
    with pytest.raises(MessageError, match=r"\$.seq"):
        decode(b'{"request_id":"r","seq":-1,"token_ids":[]}', StreamTokens)
    with pytest.raises(MessageError, match="kind"):
        decode(encode(Cancel(request_id="r")), StreamTokens)
    with pytest.raises(MessageError, match="newer"):
        decode(b'{"kind":"cancel","v":99,"request_id":"r"}', Cancel)
    with pytest.raises(MessageError, match="temperature"):  # types are the bus's check
        decode(b'{"request_id":"r","stream_subject":"s","sampling":{"temperature":"hot"}}', GenerateRequest)
    # ranges are the one schema's own check (engine.params), which the worker runs on what it takes
    bad = decode(b'{"request_id":"r","stream_subject":"s","sampling":{"temperature":-1}}', GenerateRequest)
    with pytest.raises(ValueError, match="temperature") as e:
        bad.sampling.validate()
    assert e.value.args[1] == "temperature"
    # hand-written JSON (nats CLI): kind optional for a known type, unknown fields ignored
    req = decode(b'{"request_id":"r","prompt":"Hello","stream_subject":"s","extra":1}', GenerateRequest)
    assert req.prompt == "Hello" and req.sampling.max_tokens == 256


def test_raw_subscriber_sees_json_and_request_id_header(server: EmbeddedNats) -> None:
    async def go() -> None:
        nc = await connect(fast(server.url), "pub")
        raw = await nats.connect(server.url)  # what `nats sub 'tandem.>'` sees
        try:
            sub = await raw.subscribe("tandem.>")
            await raw.flush()
            s = Subjects(model="m")
            samples = sample_messages()
            for msg in samples:
                await publish(nc, s.stream("g", "r1"), msg)
            await nc.flush(timeout=10)
            for msg in samples:
                got = await sub.next_msg(timeout=10)
                body = json.loads(got.data)
                assert body["kind"] == kind_of(type(msg))
                rid = getattr(msg, "request_id", None)
                if rid is not None:
                    assert got.headers is not None and got.headers[REQUEST_ID_HEADER] == rid
                    assert request_id_of(got) == rid
        finally:
            await raw.close()
            await nc.close()

    run(go())


def test_request_reply_helpers(server: EmbeddedNats) -> None:
    """`request` against micro endpoints, as a prefill worker asks a decode worker's `kv_meta`: the reply decoded,
    an endpoint's error answer a `ServiceError` with its code, and nobody listening an immediate error."""
    async def go() -> None:
        nc = await connect(fast(server.url), "rr")
        s = Subjects(model="m")

        async def kv_meta(req: nats.micro.Request) -> None:
            asked = decode(req.data, KVMetaRequest)
            await req.respond(encode(KVMetaReply(worker_id="p1", incarnation="i", meta={"for": asked.worker_id})))

        async def too_big(req: nats.micro.Request) -> None:
            await req.respond_error("413", "the metadata is over max_payload")

        service = await nats.micro.add_service(nc, name="rr", version="0.0.1")
        await service.add_endpoint(name="kv_meta", subject=s.kv_meta("p1"), handler=kv_meta)
        await service.add_endpoint(name="too_big", subject=s.kv_meta("p2"), handler=too_big)
        reply = await request(nc, s.kv_meta("p1"), KVMetaRequest(worker_id="d1"), KVMetaReply, timeout=10)
        assert reply.meta == {"for": "d1"}
        with pytest.raises(ServiceError) as refused:
            await request(nc, s.kv_meta("p2"), KVMetaRequest(worker_id="d1"), KVMetaReply, timeout=10)
        assert refused.value.code == "413" and "max_payload" in str(refused.value)
        with pytest.raises(nats.errors.NoRespondersError):  # unknown worker: immediate error, no hang
            await request(nc, s.kv_meta("ghost"), KVMetaRequest(worker_id="d1"), KVMetaReply, timeout=10)
        await service.stop()
        await nc.close()

    run(go())


# ---------------------------------------------------------------------------------------
# Payload limit
# ---------------------------------------------------------------------------------------


def test_check_payload_unit() -> None:
    assert check_payload(b"x" * 10, 100) == 10
    with pytest.raises(PayloadTooLarge) as ei:
        check_payload(b"x" * 90, 100, "tandem.a", {"Tandem-Request-Id": "r"})
    e = ei.value
    assert e.limit == 100 and e.size > 100 and "max_payload of 100 bytes" in str(e) and str(e.size) in str(e)


def test_oversize_refused_before_sending(tmp_path: Path) -> None:
    limit = 64 * 1024
    conf = tmp_path / "small.conf"
    conf.write_text(f"max_payload: {limit}\n")
    with EmbeddedNats(config=conf) as srv:

        async def go() -> None:
            nc = await connect(fast(srv.url), "big")
            assert nc.max_payload == limit
            s = Subjects(model="m")
            sub = await nc.subscribe(s.generate_worker("d1"))
            big = GenerateRequest(request_id="r-big", prompt_ids=list(range(20_000)), stream_subject="x")
            size = len(encode(big))
            with pytest.raises(PayloadTooLarge) as ei:
                await publish(nc, s.generate_worker("d1"), big)
            text = str(ei.value)
            assert str(limit) in text and str(ei.value.size) in text and ei.value.size >= size
            assert s.generate_worker("d1") in text
            await ensure_streams(nc, s)
            with pytest.raises(PayloadTooLarge):
                await js_publish(nc, s.generate_pool, big)
            small = GenerateRequest(request_id="r-ok", prompt_ids=[1, 2], stream_subject="x")
            await publish(nc, s.generate_worker("d1"), small)
            got = await sub.next_msg(timeout=10)  # the connection is still healthy
            assert decode(got.data, GenerateRequest).request_id == "r-ok"
            with pytest.raises(nats.errors.TimeoutError):
                await sub.next_msg(timeout=0.2)  # the big one never went out
            await nc.close()

        run(go())

    # the same limit set through EmbeddedNats(max_payload=...)
    with EmbeddedNats(max_payload=limit) as srv2:

        async def check() -> None:
            nc = await nats.connect(srv2.url)
            assert nc.max_payload == limit
            await nc.close()

        run(check())


# ---------------------------------------------------------------------------------------
# Streams
# ---------------------------------------------------------------------------------------


def unique_subjects() -> Subjects:
    return Subjects(model=f"m-{uuid.uuid4().hex[:8]}")


def test_streams_idempotent_and_updated(server: EmbeddedNats) -> None:
    async def go() -> None:
        nc = await connect(fast(server.url), "ensure")
        s = unique_subjects()
        r1 = await ensure_streams(nc, s)
        assert r1.generate_stream == r1.prefill_stream == "created"
        assert r1.generate_consumer == r1.prefill_consumer == "created"
        r2 = await ensure_streams(nc, s)
        assert set(vars(r2).values()) == {"unchanged"}
        js = nc.jetstream()
        info = await js.stream_info(s.generate_stream)
        assert info.config.subjects == [s.generate_pool]
        assert info.config.retention == api.RetentionPolicy.WORK_QUEUE
        assert info.config.max_age == pytest.approx(300.0)
        ci = await js.consumer_info(s.generate_stream, s.generate_consumer)
        assert ci.config.max_deliver == 3 and ci.config.ack_wait == pytest.approx(30.0)
        # a config change is applied and reported
        r3 = await ensure_streams(
            nc, s, generate=WorkQueueConfig(max_age=600.0, ack_wait=45.0, max_deliver=5)
        )
        assert (r3.generate_stream, r3.generate_consumer) == ("updated", "updated")
        assert (r3.prefill_stream, r3.prefill_consumer) == ("unchanged", "unchanged")
        ci = await js.consumer_info(s.generate_stream, s.generate_consumer)
        assert ci.config.max_deliver == 5
        await nc.close()

    run(go())


def test_conflicting_stream_is_reported(server: EmbeddedNats) -> None:
    async def go() -> None:
        nc = await connect(fast(server.url), "conflict")
        s = unique_subjects()
        js = nc.jetstream()
        # someone made the stream by hand with limits retention: cannot become a work queue
        await js.add_stream(
            name=s.generate_stream, subjects=[s.generate_pool], retention=api.RetentionPolicy.LIMITS
        )
        with pytest.raises(StreamConfigError) as ei:
            await ensure_streams(nc, s)
        text = str(ei.value)
        assert s.generate_stream in text and "retention" in text
        await nc.close()

    run(go())


def test_pool_message_pulled_once_and_targeted_not_captured(server: EmbeddedNats) -> None:
    async def go() -> None:
        nc = await connect(fast(server.url), "pool")
        s = unique_subjects()
        await ensure_streams(nc, s)
        w1 = await pull_subscription(nc, s, "generate")
        w2 = await pull_subscription(nc, s, "generate")
        assert await fetch_one(w1, timeout=0.2) is None  # empty queue: None after the timeout

        req = GenerateRequest(request_id="r-pool", prompt_ids=[1], stream_subject=s.stream("g", "r-pool"))
        ack = await js_publish(nc, s.generate_pool, req, msg_id="r-pool:0")
        assert ack.stream == s.generate_stream
        dup = await js_publish(nc, s.generate_pool, req, msg_id="r-pool:0")  # retried publish: stored once
        assert dup.duplicate
        assert (await pool_backlog(nc, s, "generate"))[0] == 1

        got = await fetch_one(w1, timeout=10)
        assert got is not None and request_id_of(got) == "r-pool"
        assert decode(got.data, GenerateRequest) == req
        assert await fetch_one(w2, timeout=0.3) is None  # the other worker does not get it
        await got.ack_sync(timeout=10)
        info = await nc.jetstream().stream_info(s.generate_stream)
        assert info.state.messages == 0  # work queue: gone once acked
        assert await pool_backlog(nc, s, "generate") == (0, 0)

        # a targeted request is core request-reply, not swallowed by the stream
        tsub = await nc.subscribe(s.generate_worker("d1"))
        await publish(nc, s.generate_worker("d1"), req)
        assert decode((await tsub.next_msg(timeout=10)).data, GenerateRequest) == req
        info = await nc.jetstream().stream_info(s.generate_stream)
        assert info.state.messages == 0
        await tsub.unsubscribe()
        with pytest.raises(NoStreamResponseError):  # no stream listens on the targeted subject
            await nc.jetstream().publish(s.generate_worker("d1"), b"{}", timeout=10)
        # the prefill pool is separate
        job_ack = await js_publish(nc, s.prefill_pool, sample_messages()[1])
        assert job_ack.stream == s.prefill_stream
        pw = await pull_subscription(nc, s, "prefill")
        job = await fetch_one(pw, timeout=10)
        assert job is not None and isinstance(decode_any(job.data), PrefillJob)
        await job.ack()
        assert await fetch_one(w1, timeout=0.2) is None
        await nc.close()

    run(go())


def test_unacked_message_is_redelivered(server: EmbeddedNats) -> None:
    async def go() -> None:
        nc = await connect(fast(server.url), "redeliver")
        s = unique_subjects()
        await ensure_streams(
            nc, s, generate=WorkQueueConfig(ack_wait=0.5, max_deliver=2, duplicate_window=1.0)
        )
        w = await pull_subscription(nc, s, "generate")
        await js_publish(nc, s.generate_pool, Cancel(request_id="r-x"))
        first = await fetch_one(w, timeout=10)
        assert first is not None and first.metadata.num_delivered == 1
        again = await fetch_one(w, timeout=10)  # not acked: back after ack_wait
        assert again is not None and again.metadata.num_delivered == 2
        await again.ack()
        await nc.close()

    run(go())


def test_role_permissions_on_real_server(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Subjects.permissions() is enough for a prefill worker to work, and no more."""
    s = Subjects(model="perm-model")
    perms = s.permissions(ROLE_PREFILL_ONLY, "p1")
    users = [
        {"user": "admin", "password": "admin-pw"},
        {
            "user": "prefill",
            "password": "prefill-pw",
            "permissions": {
                "publish": {"allow": perms["publish"]},
                "subscribe": {"allow": perms["subscribe"]},
                "allow_responses": True,
            },
        },
    ]
    conf = tmp_path / "perms.conf"
    conf.write_text("authorization " + json.dumps({"users": users}) + "\n")  # NATS conf accepts JSON
    caplog.set_level(logging.WARNING, logger="tandem.bus")
    with EmbeddedNats(config=conf) as srv:

        async def go() -> None:
            admin = await connect(fast(srv.url, user="admin", password="admin-pw"), "admin")
            worker = await connect(fast(srv.url, user="prefill", password="prefill-pw"), "prefill-p1")
            await ensure_streams(admin, s)
            again = await ensure_streams(worker, s)  # every role may ensure at start
            assert set(vars(again).values()) == {"unchanged"}
            done_sub = await admin.subscribe(s.prefill_done("d1", "r1"))
            job = sample_messages()[1]
            await js_publish(admin, s.prefill_pool, job)
            psub = await pull_subscription(worker, s, "prefill")
            got = await fetch_one(psub, timeout=10)
            assert got is not None and decode(got.data, PrefillJob).request_id == job.request_id
            await got.ack_sync(timeout=10)
            await publish(
                worker, s.prefill_done("d1", "r1"), PrefillDone(request_id="r1", ok=True, first_token=1)
            )
            assert decode((await done_sub.next_msg(timeout=10)).data, PrefillDone).ok
            # not allowed for a prefill worker: enqueue generate requests, write to a gateway stream
            spy = await admin.subscribe(s.stream("g", "r1"))
            await publish(worker, s.stream("g", "r1"), Cancel(request_id="r1"))
            await publish(worker, s.generate_pool, Cancel(request_id="r1"))
            await worker.flush(timeout=10)
            with pytest.raises(nats.errors.TimeoutError):
                await spy.next_msg(timeout=0.3)
            info = await admin.jetstream().stream_info(s.generate_stream)
            assert info.state.messages == 0
            await asyncio.to_thread(
                wait_until,
                lambda: caplog.text.lower().count("permissions violation") >= 2,
                5,
                "the violation to be logged",
                0.02,
            )
            await worker.close()
            await admin.close()

        run(go())


@pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs the openssl CLI to make a test certificate"
)
def test_tls_with_ca(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    conf = tmp_path / "tls.conf"
    conf.write_text(f'tls {{ cert_file: "{cert}"\n key_file: "{key}" }}\n')
    with EmbeddedNats(config=conf) as srv:

        async def go() -> None:
            nc = await connect(fast(srv.url, tls_ca=str(cert)), "tls-ok")
            await assert_round_trip(nc)
            await nc.close()
            t0 = time.monotonic()
            with pytest.raises(BusConnectError, match="refused"):  # no CA: the certificate is not trusted
                await connect(fast(srv.url, connect_timeout=20.0), "tls-untrusted")
            assert time.monotonic() - t0 < 12  # fails at once, not at the 20 s deadline
            with pytest.raises(BusConnectError, match="does not exist"):
                await connect(fast(srv.url, tls_ca=str(tmp_path / "missing.pem")), "tls-missing")

        run(go(), 45)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


@pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs the openssl CLI to make test certificates"
)
def test_mutual_tls_client_certificate(tmp_path: Path) -> None:
    """The server demands a client certificate signed by its CA: TANDEM_NATS_TLS_CERT/_KEY present one."""
    ca_key, ca = tmp_path / "ca.key", tmp_path / "ca.pem"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
             "-days", "1", "-subj", "/CN=tandem-test-ca")
    san = tmp_path / "san.ext"
    san.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, subject in (("server", "/CN=localhost"), ("client", "/CN=tandem-worker")):
        key, csr, cert = (tmp_path / f"{name}.{ext}" for ext in ("key", "csr", "pem"))
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", subject)
        extra = ["-extfile", str(san)] if name == "server" else []
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
                 "-out", str(cert), "-days", "1", *extra)
    conf = tmp_path / "mtls.conf"
    conf.write_text(f'tls {{ cert_file: "{tmp_path / "server.pem"}"\n key_file: "{tmp_path / "server.key"}"\n'
                    f' ca_file: "{ca}"\n verify: true }}\n')
    with EmbeddedNats(config=conf) as srv:

        async def go() -> None:
            opts = fast(srv.url, tls_ca=str(ca), tls_cert=str(tmp_path / "client.pem"),
                        tls_key=str(tmp_path / "client.key"))
            nc = await connect(opts, "mtls-ok")
            await assert_round_trip(nc)
            await nc.close()
            with pytest.raises(BusConnectError):  # trusted server, but no client certificate
                await connect(fast(srv.url, tls_ca=str(ca), connect_timeout=5.0), "mtls-anonymous")

        run(go(), 45)
