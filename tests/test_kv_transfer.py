"""KV transfer engines between real processes (spawned), metadata carried as JSON through pipes.

Each peer process runs a small command loop (like an actor): between commands it keeps calling
`engine.completed()`, which NIXL without a progress thread needs on the receiving side.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import torch

import kv.transfer.shm
import kv.transfer.tcp
from kv.layout import KVLayout, LayoutMismatch
from kv.transfer import TransferError, byte_ranges, choose_engine, create_engine
from kv.transfer.nixl import nixl_available
from kv.transfer.shm import SHM_DIR, ShmSegment, clean_stale
from tests.harness.wait import wait_until

pytestmark = pytest.mark.timeout(60)

os.environ.setdefault("UCX_NET_DEVICES", "lo")

LAYOUT = KVLayout(model="test-kv", dtype="float32", block_size=8, num_layers=4, num_kv_heads=2, head_dim=16)
NUM_BLOCKS = 256  # 8 KiB blocks, 2 MiB pools
CPU_ENGINES = ["shm", "tcp", "nixl"]
CTX = mp.get_context("spawn")


# ---- the peer process ---------------------------------------------------------------------------


def _peer_main(conn: Connection, kind: str, worker_id: str, layout: dict[str, Any], num_blocks: int) -> None:
    """A worker: build an engine, then obey commands while polling completed()."""
    engine = create_engine(kind, KVLayout.from_dict(layout), num_blocks, "cpu", worker_id)
    done: list[str] = []
    conn.send(("ok", engine.metadata()))
    try:
        while True:
            if conn.poll(0.001):
                cmd, args = conn.recv()
                if cmd == "exit":
                    conn.send(("ok", None))
                    return
                try:
                    conn.send(("ok", _command(engine, done, cmd, args)))
                except (TransferError, ValueError, KeyError) as e:
                    conn.send(("err", f"{type(e).__name__}: {e}"))
            done.extend(engine.completed())
    finally:
        engine.close()


def _command(engine: Any, done: list[str], cmd: str, args: dict[str, Any]) -> Any:
    pool = engine.pool.tensor
    if cmd == "fill":
        gen = torch.Generator().manual_seed(args["seed"])
        pool.copy_(torch.randn(pool.shape, generator=gen))
        return None
    if cmd == "read":
        return pool[args["blocks"]].numpy().tobytes()
    if cmd == "add_peer":
        return engine.add_peer(args["meta"])
    if cmd == "peer_incarnation":
        return engine.peers[args["worker"]]["incarnation"]
    if cmd == "choice":
        return engine.choice.get(args["worker"])
    if cmd == "grant":
        return engine.grant(args["blocks"], time.time() + args.get("seconds", 120.0))
    if cmd == "write":
        t0 = time.monotonic()
        handle = engine.write(
            args["peer"],
            args["local"],
            args["remote"],
            args["notify"],
            layers=args.get("layers"),
            deadline=time.monotonic() + args.get("deadline", 10.0),
            grant=args.get("grant", ""),
        )
        handle.wait(args.get("deadline", 10.0) + 5)
        return time.monotonic() - t0
    if cmd == "write_until_error":
        # Write again and again until one fails; report how long the failing write took.
        n = 0
        end = time.monotonic() + args["max_s"]
        while time.monotonic() < end:
            t0 = time.monotonic()
            try:
                engine.write(
                    args["peer"],
                    args["local"],
                    args["remote"],
                    f"loop-{n}",
                    deadline=time.monotonic() + args["deadline"],
                    grant=args.get("grant", ""),
                ).wait(args["deadline"] + 5)
            except TransferError as e:
                return {
                    "writes": n,
                    "error": str(e),
                    "engine": e.engine,
                    "peer": e.peer,
                    "failed_after": time.monotonic() - t0,
                }
            n += 1
        return {"writes": n, "error": None}
    if cmd == "completed":
        end = time.monotonic() + args.get("timeout", 10.0)
        while not set(args["tags"]) <= set(done) and time.monotonic() < end:
            done.extend(engine.completed())
            time.sleep(0.001)
        return list(done)
    raise ValueError(f"unknown command {cmd}")


class Peer:
    """The test's side of a peer process."""

    def __init__(self, kind: str, worker_id: str, num_blocks: int = NUM_BLOCKS, layout: KVLayout = LAYOUT):
        self.worker_id = worker_id
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(
            target=_peer_main, args=(child, kind, worker_id, layout.to_dict(), num_blocks), daemon=True
        )
        self.proc.start()
        child.close()
        self._meta: dict[str, Any] | None = None

    @property
    def meta(self) -> dict[str, Any]:
        """Metadata as a peer gets it over NATS: through JSON."""
        if self._meta is None:
            self._meta = json.loads(json.dumps(self._reply(30.0)))
        return self._meta

    def _reply(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.worker_id} did not answer within {timeout}s")
        status, value = self.conn.recv()
        if status == "err":
            raise PeerError(value)
        return value

    def send(self, cmd: str, **args: Any) -> None:
        self.conn.send((cmd, args))

    def call(self, cmd: str, timeout: float = 30.0, **args: Any) -> Any:
        self.send(cmd, **args)
        return self._reply(timeout)

    def result(self, timeout: float = 30.0) -> Any:
        return self._reply(timeout)

    def add(self, other: Peer) -> bool:
        return self.call("add_peer", meta=other.meta)

    def grant(self, blocks: list[int]) -> str:
        """A token from this (receiving) peer that lets a writer write into ``blocks``, as a prefill job carries."""
        return self.call("grant", blocks=blocks)

    def blocks(self, blocks: list[int]) -> np.ndarray:
        raw = self.call("read", blocks=blocks)
        return np.frombuffer(raw, dtype=np.float32).reshape(len(blocks), *LAYOUT.block_shape)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except (TimeoutError, OSError, EOFError):
                self.proc.kill()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


class PeerError(RuntimeError):
    """A command failed inside the peer process (the text carries the original error)."""


def start(kind: str, *names: str, num_blocks: int = NUM_BLOCKS) -> list[Peer]:
    """Start peers in parallel and wait until each has built its engine."""
    peers = [Peer(kind, n, num_blocks) for n in names]
    for p in peers:
        assert p.meta["worker_id"] == p.worker_id
    return peers


@pytest.fixture(scope="module", params=CPU_ENGINES)
def trio(request: pytest.FixtureRequest) -> Iterator[tuple[str, Peer, Peer, Peer]]:
    """One decode-like receiver and two prefill-like writers of one engine kind."""
    kind = request.param
    dec, pre1, pre2 = start(kind, "dec", "pre1", "pre2")
    try:
        pre1.add(dec)
        pre2.add(dec)
        pre1.call("fill", seed=1)
        pre2.call("fill", seed=2)
        dec.call("fill", seed=3)
        yield kind, dec, pre1, pre2
    finally:
        for p in (dec, pre1, pre2):
            p.close()


# ---- functional tests, each engine -----------------------------------------------------------------


def test_round_trip_every_block(trio: tuple[str, Peer, Peer, Peer]) -> None:
    kind, dec, pre1, _ = trio
    blocks = list(range(NUM_BLOCKS))
    pre1.call("write", peer="dec", local=blocks, remote=blocks, notify=f"{kind}-all", grant=dec.grant(blocks))
    assert f"{kind}-all" in dec.call("completed", tags=[f"{kind}-all"])
    assert dec.blocks(blocks).tobytes() == pre1.blocks(blocks).tobytes()


def test_partial_non_contiguous_blocks(trio: tuple[str, Peer, Peer, Peer]) -> None:
    kind, dec, pre1, pre2 = trio
    pre2.call("fill", seed=22)
    dec.call("fill", seed=33)
    before = dec.blocks([99, 103, 49, 52])
    local = [5, 6, 7, 20, 3, 200]
    remote = [100, 101, 102, 50, 51, 7]
    pre2.call("write", peer="dec", local=local, remote=remote, notify=f"{kind}-partial", grant=dec.grant(remote))
    assert f"{kind}-partial" in dec.call("completed", tags=[f"{kind}-partial"])
    assert dec.blocks(remote).tobytes() == pre2.blocks(local).tobytes()
    # Neighbours of the written blocks are untouched.
    assert dec.blocks([99, 103, 49, 52]).tobytes() == before.tobytes()


def test_layer_range_writes(trio: tuple[str, Peer, Peer, Peer]) -> None:
    kind, dec, pre1, _ = trio
    dec.call("fill", seed=4)
    pre1.call("fill", seed=5)
    local, remote = [10, 11, 12], [30, 31, 40]
    old = dec.blocks(remote)
    grant = dec.grant(remote)
    pre1.call("write", peer="dec", local=local, remote=remote, notify=f"{kind}-l13", layers=(1, 3), grant=grant)
    dec.call("completed", tags=[f"{kind}-l13"])
    got, src = dec.blocks(remote), pre1.blocks(local)
    assert np.array_equal(got[:, 1:3], src[:, 1:3])
    assert np.array_equal(got[:, 0], old[:, 0]) and np.array_equal(got[:, 3], old[:, 3])
    # Layer-wise streaming: the remaining layers one by one, then the blocks are complete.
    tags = []
    for layer in (0, 3):
        tags.append(f"{kind}-layer{layer}")
        pre1.call("write", peer="dec", local=local, remote=remote, notify=tags[-1], layers=(layer, layer + 1),
                  grant=grant)
    assert set(tags) <= set(dec.call("completed", tags=tags))
    assert dec.blocks(remote).tobytes() == src.tobytes()


def test_two_writers_into_one_pool_at_once(trio: tuple[str, Peer, Peer, Peer]) -> None:
    kind, dec, pre1, pre2 = trio
    pre1.call("fill", seed=6)
    pre2.call("fill", seed=7)
    one, two = list(range(0, 128)), list(range(128, 256))
    g1, g2 = dec.grant(one), dec.grant(two)
    pre1.send("write", peer="dec", local=one, remote=one, notify=f"{kind}-w1", grant=g1)
    pre2.send("write", peer="dec", local=two, remote=two, notify=f"{kind}-w2", grant=g2)
    pre1.result()
    pre2.result()
    assert {f"{kind}-w1", f"{kind}-w2"} <= set(dec.call("completed", tags=[f"{kind}-w1", f"{kind}-w2"]))
    assert dec.blocks(one).tobytes() == pre1.blocks(one).tobytes()
    assert dec.blocks(two).tobytes() == pre2.blocks(two).tobytes()


def test_writes_outside_the_peer_pool_are_refused(trio: tuple[str, Peer, Peer, Peer]) -> None:
    _, _, pre1, _ = trio
    with pytest.raises(PeerError, match="outside dec's pool"):
        pre1.call("write", peer="dec", local=[0], remote=[NUM_BLOCKS], notify="x")
    with pytest.raises(PeerError, match="unknown peer"):
        pre1.call("write", peer="nobody", local=[0], remote=[0], notify="x")


def test_peer_killed_mid_transfer_fails_within_deadline(trio: tuple[str, Peer, Peer, Peer]) -> None:
    kind, _, _, writer = trio
    (victim,) = start(kind, "victim")
    try:
        writer.add(victim)
        blocks = list(range(NUM_BLOCKS))
        writer.send("write_until_error", peer="victim", local=blocks, remote=blocks, deadline=3.0, max_s=30.0,
                    grant=victim.grant(blocks))
        # The writer starts write n+1 only once write n is done: the victim seeing "loop-1" means
        # at least one write completed. (The "completed" command waits up to 10 s for the tag.)
        victim.send("completed", tags=["loop-1"], timeout=10.0)
        assert "loop-1" in victim.result(timeout=20), "the writes never got going"
        victim.kill()
        killed = time.monotonic()
        out = writer.result(timeout=15)
        assert out["error"] is not None, f"writes kept succeeding after the peer died: {out}"
        # the failing write gives up at its 3 s deadline (plus slack for a busy machine), long
        # before the 15 s a hang would run into
        assert time.monotonic() - killed < 3.0 + 5.0
        assert out["writes"] > 0
        assert out["engine"] == kind and out["peer"] == "victim"
        assert kind in out["error"] and "victim" in out["error"] and "bytes" in out["error"]
    finally:
        victim.close()


def wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP lands asynchronously: wait until every thread of `pid` is in state T."""
    def stopped() -> bool:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        return all(st in ("T", "t") for st in states)

    wait_until(stopped, timeout, f"process {pid} to stop", interval=0.01)


def test_stalled_peer(trio: tuple[str, Peer, Peer, Peer]) -> None:
    """A stopped receiver: tcp and nixl writes fail at their deadline; shm writes still land."""
    kind, _, _, writer = trio
    (stalled,) = start(kind, "stalled")
    try:
        writer.add(stalled)
        grant = stalled.grant(list(range(64)))
        writer.call("write", peer="stalled", local=[1], remote=[1], notify="warm", grant=grant)
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        wait_stopped(stalled.proc.pid)
        t0 = time.monotonic()
        try:
            if kind == "shm":
                writer.call(
                    "write", peer="stalled", local=[1, 2], remote=[3, 4], notify="while-stopped", deadline=1.0,
                    grant=grant,
                )
            else:
                with pytest.raises(
                    PeerError, match=rf"via {kind} to stalled \(\d+ bytes\) failed: .*deadline"
                ):
                    writer.call(
                        "write",
                        peer="stalled",
                        local=list(range(64)),
                        remote=list(range(64)),
                        notify="x",
                        deadline=1.0,
                        grant=grant,
                    )
            assert time.monotonic() - t0 < 1.0 + 5.0  # the 1 s deadline, not the 30 s a hang would take
        finally:
            os.kill(stalled.proc.pid, signal.SIGCONT)
        if kind == "shm":
            assert "while-stopped" in stalled.call("completed", tags=["while-stopped"])
    finally:
        stalled.close()


def test_restart_with_new_incarnation(trio: tuple[str, Peer, Peer, Peer]) -> None:
    kind, _, _, writer = trio
    (first,) = start(kind, "phoenix")
    second: Peer | None = None
    try:
        writer.call("fill", seed=8)
        assert writer.add(first) is True
        assert writer.add(first) is False  # same incarnation: cached
        writer.call("write", peer="phoenix", local=[0, 1], remote=[0, 1], notify="v1", grant=first.grant([0, 1]))
        first.kill()
        with pytest.raises(PeerError, match="TransferError"):
            writer.call(
                "write", peer="phoenix", local=[0, 1], remote=[0, 1], notify="to-the-dead", deadline=1.0
            )
        (second,) = start(kind, "phoenix")
        assert second.meta["incarnation"] != first.meta["incarnation"]
        assert writer.add(second) is True
        assert writer.call("peer_incarnation", worker="phoenix") == second.meta["incarnation"]
        blocks = [4, 5, 6, 9]
        writer.call("write", peer="phoenix", local=blocks, remote=blocks, notify="v2", grant=second.grant(blocks))
        assert "v2" in second.call("completed", tags=["v2"])
        assert second.blocks(blocks).tobytes() == writer.blocks(blocks).tobytes()
    finally:
        for p in (first, second):
            if p is not None:
                p.close()


@pytest.mark.parametrize("kind", CPU_ENGINES)
def test_layout_mismatch_is_refused(kind: str) -> None:
    other = KVLayout(
        model="test-kv", dtype="float32", block_size=8, num_layers=4, num_kv_heads=2, head_dim=32
    )
    ours = create_engine(kind, LAYOUT, 4, "cpu", "ours")
    theirs = create_engine(kind, other, 4, "cpu", "theirs")
    try:
        with pytest.raises(LayoutMismatch) as err:
            ours.add_peer(json.loads(json.dumps(theirs.metadata())))
        assert LAYOUT.describe() in str(err.value) and other.describe() in str(err.value)
        assert "theirs" not in ours.peers
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize("kind", CPU_ENGINES)
def test_in_process_pair_small_chunks_strided_layers_and_cancel(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunking and strided layer copies inside one process (cheap), and cancel semantics."""
    monkeypatch.setattr(kv.transfer.shm, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(kv.transfer.tcp, "CHUNK_BYTES", 1000)
    a = create_engine(kind, LAYOUT, 32, "cpu", "a")
    b = create_engine(kind, LAYOUT, 32, "cpu", "b")
    try:
        a.pool.tensor.copy_(torch.randn(a.pool.tensor.shape))
        a.add_peer(json.loads(json.dumps(b.metadata())))
        handles = [
            a.write("b", [0, 1, 2, 3, 9], [5, 6, 7, 8, 20], "whole", grant=b.grant([5, 6, 7, 8, 20], time.time() + 60)),
            a.write("b", [10, 11, 12], [12, 14, 16], "layers", layers=(1, 3),
                    grant=b.grant([12, 14, 16], time.time() + 60)),
            a.write("b", [], [], "empty", grant=b.grant([], time.time() + 60)),
        ]
        seen: list[str] = []

        def landed() -> bool:  # both sides poll: NIXL without a progress thread moves only while they do
            done = [h.poll() for h in handles]
            seen.extend(b.completed())
            return all(done) and {"whole", "layers", "empty"} <= set(seen)

        wait_until(landed, 10, lambda: f"the writes to land (saw only {seen})", 0.001)
        assert torch.equal(b.pool.tensor[[5, 6, 7, 8, 20]], a.pool.tensor[[0, 1, 2, 3, 9]])
        assert torch.equal(b.pool.tensor[[12, 14, 16], 1:3], a.pool.tensor[[10, 11, 12], 1:3])
        assert not b.pool.tensor[[12, 14, 16], 0].any() and not b.pool.tensor[[12, 14, 16], 3].any()
        h = a.write("b", list(range(32)), list(range(32)), "cancelled", grant=b.grant(list(range(32)), time.time() + 60))
        h.cancel()
        with pytest.raises(TransferError, match="cancelled"):
            h.wait(5)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", ["shm", "tcp", "auto"])
def test_landings_wake_the_receivers_descriptor_and_the_writers_loop(kind: str) -> None:
    """No polling on either side: the writer's event loop is woken by its write's end, the receiver's by a
    completion descriptor that turns readable when the notice is there and quiet once it is read."""
    a = create_engine(kind, LAYOUT, 32, "cpu", "a")
    b = create_engine(kind, LAYOUT, 32, "cpu", "b")
    try:
        a.pool.tensor.copy_(torch.randn(a.pool.tensor.shape))
        a.add_peer(json.loads(json.dumps(b.metadata())))
        fds = b.completion_fds()
        assert fds and not b.needs_polling_for(a.mechanism("b"))
        assert select.select(fds, [], [], 0)[0] == []

        token = b.grant([4, 5, 6], time.time() + 60)

        async def landed() -> list[str]:
            loop = asyncio.get_running_loop()
            woken = asyncio.Event()
            for fd in fds:
                loop.add_reader(fd, woken.set)
            try:
                await asyncio.wait_for(a.write("b", [0, 1, 2], [4, 5, 6], "evented", grant=token).wait_async(), 30)
                await asyncio.wait_for(woken.wait(), 30)
                return b.completed()
            finally:
                for fd in fds:
                    loop.remove_reader(fd)

        assert asyncio.run(landed()) == ["evented"]
        assert select.select(fds, [], [], 0)[0] == []
        assert torch.equal(b.pool.tensor[[4, 5, 6]], a.pool.tensor[[0, 1, 2]])
        h = a.write("b", list(range(32)), list(range(32)), "cancelled", grant=b.grant(list(range(32)), time.time() + 60))
        h.cancel()
        with pytest.raises(TransferError, match="cancelled"):
            asyncio.run(h.wait_async())
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(not nixl_available(), reason="needs NIXL")
def test_nixl_without_a_progress_thread_says_it_needs_polling() -> None:
    a = create_engine("nixl", LAYOUT, 8, "cpu", "a")
    b = create_engine("auto", LAYOUT, 8, "cpu", "b")
    try:
        assert a.needs_polling and a.completion_fds() == []
        assert b.needs_polling and b.needs_polling_for("nixl") and b.needs_polling_for("")
        assert not b.needs_polling_for("shm") and not b.needs_polling_for("tcp")
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", CPU_ENGINES)
def test_write_for_an_earlier_incarnation_is_refused(kind: str) -> None:
    """A job for a peer that has since restarted under its worker id must not write into the new process's blocks."""
    a = create_engine(kind, LAYOUT, 8, "cpu", "a")
    b = create_engine(kind, LAYOUT, 8, "cpu", "b")
    try:
        a.add_peer(json.loads(json.dumps(b.metadata())))
        with pytest.raises(TransferError, match="peer restarted"):
            a.write("b", [0], [0], "stale", incarnation="an-earlier-b")
        h = a.write("b", [0], [0], "", incarnation=b.incarnation, grant=b.grant([0], time.time() + 60))

        def landed() -> bool:  # both sides poll: NIXL without a progress thread needs it
            b.completed()
            return h.poll()

        wait_until(landed, 10, "the write to land", 0.001)
    finally:
        a.close()
        b.close()


def test_tcp_takes_a_write_only_with_a_live_grant_for_its_blocks() -> None:
    """Knowing a pool's address, layout and incarnation (what kv.meta tells anyone who asks) is not enough to
    write into it: each write needs the token its owner granted for those blocks, until revoked or expired."""
    a = create_engine("tcp", LAYOUT, 8, "cpu", "a")
    b = create_engine("tcp", LAYOUT, 8, "cpu", "b")
    try:
        a.pool.tensor.copy_(torch.randn(a.pool.tensor.shape))
        a.add_peer(json.loads(json.dumps(b.metadata())))
        soon = time.time() + 60
        granted = b.grant([2, 3], soon)
        revoked = b.grant([2, 3], soon)
        b.revoke(revoked)
        expired = b.grant([2, 3], time.time() - 1)
        for token, why in (("", "no valid write grant"), ("f" * 32, "no valid write grant"),
                           (revoked, "no valid write grant"), (expired, "no valid write grant|expired"),
                           (b.grant([2], soon), "outside the blocks the grant covers")):
            with pytest.raises(TransferError, match=f"the peer refused the write: .*({why})"):
                a.write("b", [0, 1], [2, 3], "stray", grant=token).wait(10)
        assert not b.pool.tensor[[2, 3]].any() and b.completed() == []
        with pytest.raises(TransferError, match="outside the blocks"):
            a.write("b", [0, 1, 2], [2, 3, 4], "too-far", grant=granted).wait(10)
        a.write("b", [0, 1], [2, 3], "layer", layers=(1, 2), grant=granted).wait(10)  # a slice of a granted block
        a.write("b", [0, 1], [2, 3], "granted", grant=granted).wait(10)
        assert torch.equal(b.pool.tensor[[2, 3]], a.pool.tensor[[0, 1]])
        assert b.completed() == ["layer", "granted"]
        b.revoke(granted)
        with pytest.raises(TransferError, match="no valid write grant"):
            a.write("b", [0, 1], [2, 3], "late", grant=granted).wait(10)
    finally:
        a.close()
        b.close()


def test_tcp_writes_queued_to_a_removed_peer_end_at_once() -> None:
    """Writes waiting behind a slow one end when their peer is removed, instead of at their deadline."""
    a = create_engine("tcp", LAYOUT, NUM_BLOCKS, "cpu", "a")
    b = create_engine("tcp", LAYOUT, NUM_BLOCKS, "cpu", "b")
    try:
        a.add_peer(json.loads(json.dumps(b.metadata())))
        deadline = time.monotonic() + 60
        every = list(range(NUM_BLOCKS))
        token = b.grant(every, time.time() + 60)
        handles = [a.write("b", every, every, f"w{i}", deadline=deadline, grant=token) for i in range(20)]
        a.remove_peer("b")
        t0 = time.monotonic()
        outcomes = []
        for h in handles:
            try:
                h.wait(30)
                outcomes.append("ok")
            except TransferError as e:
                outcomes.append(str(e))
        assert time.monotonic() - t0 < 20, outcomes  # not the 60 s deadline
        assert any("removed" in o for o in outcomes), outcomes
        wait_until(lambda: not a._inflight, 10, "the engine to forget the ended writes", 0.01)
    finally:
        a.close()
        b.close()


def test_closing_a_shm_engine_leaves_its_pool_usable() -> None:
    """close() unlinks the segment but never unmaps memory a tensor still views (that would be a SIGSEGV)."""
    code = (
        "from kv.layout import KVLayout; from kv.transfer import create_engine\n"
        "layout = KVLayout(model='t', dtype='float32', block_size=8, num_layers=2, num_kv_heads=2, head_dim=16)\n"
        "e = create_engine('shm', layout, 4, 'cpu', 'closer')\n"
        "pool = e.pool\n"
        "e.close()\n"
        "pool.tensor.fill_(1.0)\n"
        "print(float(pool.tensor.sum()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert float(out.stdout.strip()) > 0


def test_auto_completions_survive_one_failing_engine() -> None:
    engine = create_engine("auto", LAYOUT, 4, "cpu", "auto-notices")
    real = engine.engines
    try:
        class Broken:
            def completed(self) -> list[str]:
                raise RuntimeError("boom")

        class Fine:
            def completed(self) -> list[str]:
                return ["landed-1"]

        engine.engines = {"broken": Broken(), "fine": Fine()}
        assert engine.completed() == ["landed-1"]
    finally:
        engine.engines = real
        engine.close()


# ---- auto ------------------------------------------------------------------------------------------


def test_auto_on_one_host_picks_shm_and_round_trips() -> None:
    dec, pre = start("auto", "dec", "pre")
    try:
        assert {"shm", "tcp"} <= set(dec.meta["mechanisms"])
        assert ("nixl" in dec.meta["mechanisms"]) == nixl_available()
        assert pre.add(dec) is True
        assert pre.call("choice", worker="dec") == "shm"
        pre.call("fill", seed=9)
        pre.call("write", peer="dec", local=[0, 1, 2, 50], remote=[10, 11, 12, 13], notify="auto")
        assert "auto" in dec.call("completed", tags=["auto"])
        assert dec.blocks([10, 11, 12, 13]).tobytes() == pre.blocks([0, 1, 2, 50]).tobytes()
    finally:
        dec.close()
        pre.close()


def _meta(host: str, device: str = "cpu", **mechs: dict[str, Any]) -> dict[str, Any]:
    return {"worker_id": f"w@{host}", "host_id": host, "device": device, "mechanisms": mechs}


def test_choose_engine_rules() -> None:
    shm = {"segment": "tandem-kv-x-1-0000abcd", "socket": "/dev/shm/x.sock"}
    nixl = {"backend": "UCX"}
    tcp = {"host": "127.0.0.1", "port": 1}
    me = _meta("h1", shm=shm, nixl=nixl, tcp=tcp)
    assert choose_engine(me, _meta("h1", shm=shm, nixl=nixl, tcp=tcp)) == "shm"
    assert choose_engine(me, _meta("h2", shm=shm, nixl=nixl, tcp=tcp)) == "nixl"
    assert choose_engine(me, _meta("h2", shm=shm, tcp=tcp)) == "tcp"
    assert choose_engine(me, _meta("h1", nixl=nixl, tcp=tcp)) == "nixl"  # peer's pool not in shm
    assert choose_engine(me, _meta("h1", nixl={"backend": "LIBFABRIC"}, tcp=tcp)) == "tcp"
    gpu = _meta("h1", "cuda", cuda_ipc={}, nixl=nixl, tcp=tcp)
    assert choose_engine(gpu, _meta("h1", "cuda", cuda_ipc={}, nixl=nixl, tcp=tcp)) == "cuda_ipc"
    assert choose_engine(gpu, _meta("h2", "cuda", cuda_ipc={}, nixl=nixl, tcp=tcp)) == "nixl"
    with pytest.raises(TransferError, match="no common engine"):
        choose_engine(_meta("h1", tcp=tcp), _meta("h2", nixl=nixl))


def test_byte_ranges_coalesce_and_layers() -> None:
    b = LAYOUT.block_bytes
    assert byte_ranges(LAYOUT, [3, 4, 5, 9], [7, 8, 9, 1]) == [(3 * b, 7 * b, 3 * b), (9 * b, 1 * b, b)]
    assert byte_ranges(LAYOUT, [3, 4], [7, 9]) == [(3 * b, 7 * b, b), (4 * b, 9 * b, b)]
    per_layer = b // LAYOUT.num_layers
    assert byte_ranges(LAYOUT, [3, 4], [7, 8], layers=(1, 3)) == [
        (3 * b + per_layer, 7 * b + per_layer, 2 * per_layer),
        (4 * b + per_layer, 8 * b + per_layer, 2 * per_layer),
    ]
    assert byte_ranges(LAYOUT, [3, 4], [7, 8], layers=(0, 4)) == [(3 * b, 7 * b, 2 * b)]
    with pytest.raises(ValueError):
        byte_ranges(LAYOUT, [1], [1], layers=(2, 5))


# ---- shared-memory hygiene ------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait(10)
    return proc.pid


def test_shm_segments_private_unlinked_and_stale_ones_cleaned() -> None:
    stale = os.path.join(SHM_DIR, f"tandem-kv-crashed-{_dead_pid()}-0123abcd")
    with open(stale, "wb") as f:
        f.write(b"x")
    with open(stale + ".sock", "wb") as f:
        f.write(b"")
    engine = create_engine("shm", LAYOUT, 4, "cpu", "hygiene")
    try:
        assert not os.path.exists(stale) and not os.path.exists(stale + ".sock")
        mech = engine.metadata()["mechanisms"]["shm"]
        seg_path = os.path.join(SHM_DIR, mech["segment"])
        assert os.stat(seg_path).st_mode & 0o777 == 0o600
        assert os.stat(mech["socket"]).st_mode & 0o777 == 0o600
    finally:
        engine.close()
    assert not os.path.exists(seg_path) and not os.path.exists(mech["socket"])


def test_shm_segment_of_a_killed_peer_is_cleaned_at_next_start() -> None:
    (peer,) = start("shm", "doomed")
    name = peer.meta["mechanisms"]["shm"]["segment"]
    peer.kill()
    peer.close()
    assert os.path.exists(os.path.join(SHM_DIR, name))  # SIGKILL: nobody unlinked it
    assert name in clean_stale()
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    with pytest.raises(FileNotFoundError):
        ShmSegment.attach(name)


# ---- GPU engines ------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_peer(conn: Connection, kind: str, worker_id: str, seed: int) -> None:
    """A GPU worker: send metadata, then either receive (poll) or write what it is told."""
    engine = create_engine(kind, LAYOUT, 64, "cuda", worker_id)
    gen = torch.Generator().manual_seed(seed)
    engine.pool.tensor.copy_(torch.randn(engine.pool.tensor.shape, generator=gen).cuda())
    conn.send(engine.metadata())
    done: list[str] = []
    try:
        while True:
            if conn.poll(0.001):
                msg = conn.recv()
                if msg["cmd"] == "exit":
                    return
                if msg["cmd"] == "write":
                    engine.add_peer(msg["meta"])
                    engine.write(msg["peer"], msg["local"], msg["remote"], "gpu").wait(20)
                    conn.send(engine.pool.tensor[msg["local"]].cpu().numpy().tobytes())
                if msg["cmd"] == "wait":
                    end = time.monotonic() + 20
                    while "gpu" not in done and time.monotonic() < end:
                        done.extend(engine.completed())
                    conn.send(engine.pool.tensor[msg["blocks"]].cpu().numpy().tobytes())
            done.extend(engine.completed())
    finally:
        engine.close()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["cuda_ipc", "nixl", "auto"])
def test_gpu_round_trip(kind: str) -> None:
    if kind == "cuda_ipc":
        pytest.importorskip("cupy")
    ends = [CTX.Pipe() for _ in range(2)]
    procs = [
        CTX.Process(target=_gpu_peer, args=(ends[i][1], kind, name, i), daemon=True)
        for i, name in enumerate(("gdec", "gpre"))
    ]
    for p in procs:
        p.start()
    try:
        dec_meta = ends[0][0].recv()
        ends[1][0].recv()
        local, remote = [0, 1, 2, 7], [10, 11, 12, 30]
        ends[1][0].send({"cmd": "write", "meta": dec_meta, "peer": "gdec", "local": local, "remote": remote})
        assert ends[1][0].poll(30)
        sent = ends[1][0].recv()
        ends[0][0].send({"cmd": "wait", "blocks": remote})
        assert ends[0][0].poll(30)
        assert ends[0][0].recv() == sent
    finally:
        for conn, _ in ends:
            conn.send({"cmd": "exit"})
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def test_missing_nixl_warns_only_where_it_is_the_only_path(caplog: pytest.LogCaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """auto without NIXL says so quietly at start (shm and TCP serve every peer); a peer that only NIXL could
    reach gets a warning and an error naming the package that would fix it."""
    import logging

    import kv.transfer.nixl

    def missing(*args: Any, **kw: Any) -> None:
        raise ImportError("NIXL is not installed (pip install nixl-cu12): no module named nixl")

    monkeypatch.setattr(kv.transfer.nixl, "NixlEngine", missing)

    with caplog.at_level(logging.INFO, logger="kv.transfer"):
        engine = create_engine("auto", LAYOUT, 4, "cpu", "w-nixl-test")
    try:
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("nixl-cu12" in r.getMessage() for r in caplog.records)  # the INFO line names it
        caplog.clear()
        peer = {**engine.metadata(), "worker_id": "far", "incarnation": "i", "host_id": "another-host",
                "mechanisms": {"nixl": {"backend": "ucx"}}}
        with caplog.at_level(logging.WARNING, logger="kv.transfer"), pytest.raises(TransferError,
                                                                                        match="pip install nixl-cu12"):
            engine.add_peer(peer)
        assert any("nixl-cu12" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        tcp_peer = {**engine.metadata(), "worker_id": "near", "incarnation": "j", "host_id": "another-host",
                    "mechanisms": {k: v for k, v in engine.metadata()["mechanisms"].items() if k == "tcp"}}
        caplog.clear()
        engine.add_peer(tcp_peer)  # reachable without NIXL: no warning
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        engine.close()
