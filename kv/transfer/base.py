"""The one interface every KV transfer engine implements, and the pieces they share.

A worker builds one engine over its local `KVPool` at start. `metadata()` describes how peers
reach that pool (a JSON-able dict the caller carries over NATS, at ``tandem.kv.meta.<worker>``);
a peer passes it to `add_peer()` and then `write()`s blocks of its own pool into blocks of ours.
Every engine pushes (the prefill side writes, the decode side receives), so the side that owns
the destination blocks learns that bytes landed only through `completed()`, which returns the
notify tags of writes that have fully landed. A receiver need not poll for them: an engine's
`completion_fds()` turn readable when `completed()` has news (an event loop waits on them); only an
engine whose `needs_polling` is true (NIXL without a progress thread moves bytes only while both
sides poll, DESIGN §5) must have `completed()` called while writes are expected. A writer waits on
its handles (`wait()`, or `wait_async()` on an event loop). A write's bytes may be used only after its
tag appears in `completed()`; after a failure or `cancel()` the destination blocks hold undefined
bytes and a late write may still land, so the receiver quarantines them (DESIGN §4).

Metadata shape (every engine, including ``auto``)::

    {"engine": "shm", "worker_id": ..., "incarnation": ..., "host_id": ..., "pid": ...,
     "device": "cpu", "layout": {...}, "fingerprint": ..., "num_blocks": ...,
     "mechanisms": {"shm": {...}, "tcp": {...}, "nixl": {...}}}

``mechanisms`` lists what a peer may use to reach this pool; a single engine lists itself,
``auto`` lists all of its sub-engines (see `kv.transfer.auto`). Byte ranges follow the
block-major pool: a block's bytes are contiguous, and inside a block each layer's K and V are
contiguous, so a run of adjacent blocks is one range and a layer range of one block is one range.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kv.layout import KVLayout, LayoutMismatch
from kv.pool import KVPool, paired_runs

log = logging.getLogger("kv.transfer")

# A write without an explicit deadline still ends: never a hang (DESIGN §4).
DEFAULT_TIMEOUT_S = 60.0


class TransferError(RuntimeError):
    """A write that failed, stalled past its deadline or was cancelled; names engine, peer, bytes."""

    def __init__(self, engine: str, peer: str, nbytes: int, reason: str):
        super().__init__(f"KV transfer via {engine} to {peer} ({nbytes} bytes) failed: {reason}")
        self.engine = engine
        self.peer = peer
        self.nbytes = nbytes
        self.reason = reason


def new_incarnation() -> str:
    """A fresh id per process run, so peers notice a restart and drop cached metadata."""
    return uuid.uuid4().hex


def host_id() -> str:
    """Hostname plus kernel boot id: equal only for processes that can share memory on one host."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def device_kind(device: Any) -> str:
    """'cpu' or 'cuda': what matters for choosing an engine."""
    return "cuda" if str(device).startswith("cuda") else "cpu"


def byte_ranges(
    layout: KVLayout,
    local_blocks: list[int],
    remote_blocks: list[int],
    layers: tuple[int, int] | None = None,
) -> list[tuple[int, int, int]]:
    """(local_offset, remote_offset, nbytes) ranges for a block-to-block copy.

    Adjacent blocks on both sides are coalesced into one range; with a layer range
    ``[first, last)`` (indices inside a block: its group's layers) that is not every layer, each
    block contributes one range (the layer slices of one block are contiguous, those of two blocks are not).
    """
    block, size = layout.block_bytes, layout.group_size
    runs = paired_runs(list(local_blocks), list(remote_blocks))
    if layers is None or (layers[0] == 0 and layers[1] == size):
        return [(s * block, d * block, n * block) for s, d, n in runs]
    first, last = layers
    if not 0 <= first < last <= size:
        raise ValueError(f"layer range {layers} outside [0, {size})")
    per_layer = block // size
    head, length = first * per_layer, (last - first) * per_layer
    ranges: list[tuple[int, int, int]] = []
    for s, d, n in runs:
        for i in range(n):
            ranges.append(((s + i) * block + head, (d + i) * block + head, length))
    return ranges


def strided_groups(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int, int, int]]:
    """Fold equal-length ranges at constant strides: (src, dst, nbytes, count, src_stride, dst_stride).

    A layer-range write of n blocks is n ranges one block apart; as one strided group it is one
    copy call instead of n (per-call overhead dominates small ranges).
    """
    groups: list[list[int]] = []
    for s, d, n in ranges:
        if groups:
            g = groups[-1]
            if g[2] == n:
                if g[3] == 1 and s - g[0] >= n and d - g[1] >= n:
                    g[3], g[4], g[5] = 2, s - g[0], d - g[1]
                    continue
                if g[3] > 1 and s == g[0] + g[3] * g[4] and d == g[1] + g[3] * g[5]:
                    g[3] += 1
                    continue
        groups.append([s, d, n, 1, n, n])
    return [(g[0], g[1], g[2], g[3], g[4], g[5]) for g in groups]


#: mechanisms whose receiver refuses a write without a live grant: once an attempt's grant is revoked, none
#: of its bytes can land (the others, shared memory and NIXL, write without the receiver taking part)
GRANT_CHECKED = frozenset({"tcp"})


class WriteGrants:
    """Which writes a pool accepts from the network: one random token per prefill attempt, for its blocks only.

    Why: an engine that takes writes from anyone who can connect (TCP) must not let a stranger who
    learnt the pool's address write into it. The decode worker grants a token for the blocks it
    reserved for one prefill attempt, sends it in the (authenticated) prefill job, and revokes it when
    the attempt ends, so a late or stray write is refused before a byte lands. Tokens expire at the
    attempt's deadline (epoch seconds) in any case.
    """

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._grants: dict[str, tuple[frozenset[int], float]] = {}
        self._lock = threading.Lock()

    def grant(self, blocks: list[int], deadline: float) -> str:
        """A token allowing writes into ``blocks`` until ``deadline`` (``time.time()`` seconds)."""
        token = secrets.token_hex(16)
        with self._lock:
            now = time.time()
            for old in [k for k, (_, until) in self._grants.items() if until < now]:
                del self._grants[old]
            self._grants[token] = (frozenset(blocks), deadline)
        return token

    def revoke(self, token: str) -> None:
        """No more writes with ``token`` (its attempt ended: landed, failed or given up)."""
        with self._lock:
            self._grants.pop(token, None)

    def refusal(self, token: str, ranges: list[tuple[int, int]]) -> str:
        """Why a write of ``ranges`` ((offset, nbytes) in this pool) with ``token`` is refused ('' when allowed)."""
        with self._lock:
            found = self._grants.get(token) if token else None
        if found is None:
            return "no valid write grant (the prefill job's token is unknown, revoked or missing)"
        blocks, until = found
        if time.time() > until:
            return "the write grant expired"
        for off, n in ranges:
            if n and not all(b in blocks for b in range(off // self.block_bytes, (off + n - 1) // self.block_bytes + 1)):
                return f"bytes {off}..{off + n} fall outside the blocks the grant covers"
        return ""


class Doorbell:
    """A socket pair that an engine's own threads ring when notices arrive and an event loop waits on."""

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)

    def fileno(self) -> int:
        return self._read.fileno()

    def ring(self) -> None:
        try:
            self._write.send(b"\0")
        except (BlockingIOError, InterruptedError):
            return  # bytes are already waiting: the bell is rung

    def clear(self) -> None:
        """Swallow the rings so far (before taking the notices, so a later ring is never lost)."""
        try:
            while self._read.recv(4096):
                continue
        except (BlockingIOError, InterruptedError):
            return

    def close(self) -> None:
        self._read.close()
        self._write.close()


class TransferHandle(abc.ABC):
    """One write in flight. `poll()` never blocks; `wait()` blocks at most until the deadline."""

    def __init__(self, engine: str, peer: str, nbytes: int, deadline: float, notify: str):
        self.engine = engine
        self.peer = peer
        self.nbytes = nbytes
        self.deadline = deadline
        self.notify = notify
        self.started = time.monotonic()
        self.finished: float | None = None
        self._error: TransferError | None = None

    def error(self, reason: str) -> TransferError:
        return TransferError(self.engine, self.peer, self.nbytes, reason)

    @abc.abstractmethod
    def _check(self) -> bool:
        """True once the bytes landed; raises TransferError on failure."""

    @abc.abstractmethod
    def _abort(self) -> None:
        """Stop the transfer as far as the engine can (the remote blocks are then undefined)."""

    def _block(self, seconds: float) -> None:
        """Wait up to `seconds` for progress; engines with a future override this."""
        time.sleep(min(seconds, 0.0005))

    def poll(self) -> bool:
        """True when done, False while pending; raises TransferError on failure or deadline."""
        if self._error is not None:
            raise self._error
        if self.finished is not None:
            return True
        try:
            done = self._check()
        except TransferError as e:
            self._error = e
            raise
        if done:
            self.finished = time.monotonic()
            return True
        if time.monotonic() >= self.deadline:
            self._fail(f"deadline passed after {time.monotonic() - self.started:.3f}s")
        return False

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; a failure, the deadline or `timeout` raises TransferError (and cancels)."""
        end = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        while not self.poll():
            left = end - time.monotonic()
            if left <= 0:
                self._fail(f"not done within wait timeout after {time.monotonic() - self.started:.3f}s")
            self._block(left)

    async def wait_async(self) -> None:
        """`wait()` for an event loop: the loop never blocks (engines with a future are woken by it)."""
        await asyncio.to_thread(self.wait)

    def cancel(self) -> None:
        """Abandon the write; the destination blocks are undefined until the peer reuses them safely."""
        if self.finished is None and self._error is None:
            self._abort()
            self._error = self.error("cancelled")

    @property
    def elapsed(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def _fail(self, reason: str) -> None:
        self._abort()
        self._error = self.error(reason)
        raise self._error


class FutureHandle(TransferHandle):
    """A write run by a background thread; the thread checks `cancelled` between chunks."""

    def __init__(self, engine: str, peer: str, nbytes: int, deadline: float, notify: str):
        super().__init__(engine, peer, nbytes, deadline, notify)
        self.future: Future[None] = Future()
        self.cancelled = threading.Event()

    def _check(self) -> bool:
        if not self.future.done():
            return False
        exc = self.future.exception()
        if exc is None:
            return True
        if isinstance(exc, TransferError):
            raise exc
        raise self.error(f"{type(exc).__name__}: {exc}") from exc

    def _abort(self) -> None:
        self.cancelled.set()

    def _block(self, seconds: float) -> None:
        try:
            self.future.exception(timeout=seconds)
        except FutureTimeout:
            return

    async def wait_async(self) -> None:
        """Woken by the writing thread's future, not by polling; a failure or the deadline raises."""
        if not self.poll():
            await asyncio.wait([asyncio.wrap_future(self.future)],
                               timeout=max(0.0, self.deadline - time.monotonic()))
            if not self.poll():
                self._fail(f"deadline passed after {time.monotonic() - self.started:.3f}s")


class DoneHandle(TransferHandle):
    """A write that finished inside `write()` (nothing to move, or a synchronous engine)."""

    def __init__(self, engine: str, peer: str, nbytes: int, notify: str):
        super().__init__(engine, peer, nbytes, time.monotonic() + DEFAULT_TIMEOUT_S, notify)

    def _check(self) -> bool:
        return True

    def _abort(self) -> None:
        return None


class TransferEngine(abc.ABC):
    """Move KV blocks from this worker's pool into a peer's pool; observe writes into ours.

    Constructed over a local pool (allocated by `kv.transfer.create_engine`, which knows where
    each engine needs it: shm engines need it in a shared-memory segment).
    """

    name: str = "base"

    def __init__(self, pool: KVPool, worker_id: str, incarnation: str | None = None):
        self.pool = pool
        self.worker_id = worker_id
        self.incarnation = incarnation or new_incarnation()
        self.host_id = host_id()
        self.peers: dict[str, dict[str, Any]] = {}
        self._inflight: set[TransferHandle] = set()  # writes not finished yet, cancelled by close()
        self._closed = False
        self._peers_lock = threading.Lock()  # add_peer runs in worker threads, two jobs may race
        self.grants = WriteGrants(pool.block_bytes)  # which writes from the network land (engines that check)

    # ---- description -------------------------------------------------------------------------

    def mechanisms(self) -> dict[str, dict[str, Any]]:
        """Engine fields under metadata['mechanisms']: how peers reach this pool."""
        return {self.name: self._mechanism()}

    @abc.abstractmethod
    def _mechanism(self) -> dict[str, Any]:
        """This engine's JSON-able fields (agent blob, segment name, host/port)."""

    def metadata(self) -> dict[str, Any]:
        """Everything a peer needs to write into our pool; JSON-serialisable."""
        return {
            "engine": self.name,
            "worker_id": self.worker_id,
            "incarnation": self.incarnation,
            "host_id": self.host_id,
            "pid": os.getpid(),
            "device": device_kind(self.pool.device),
            "layout": self.pool.layout.to_dict(),
            "fingerprint": self.pool.layout.fingerprint(),
            "num_blocks": self.pool.num_blocks,
            "mechanisms": self.mechanisms(),
        }

    # ---- peers --------------------------------------------------------------------------------

    def add_peer(self, meta: dict[str, Any]) -> bool:
        """Cache a peer's metadata; True when it is new or replaced an older incarnation.

        Raises `LayoutMismatch` when the peer's KV layout differs from ours.
        """
        theirs = KVLayout.from_dict(meta["layout"])
        if theirs.fingerprint() != self.pool.layout.fingerprint():
            raise LayoutMismatch(self.pool.layout, theirs)
        worker = meta["worker_id"]
        with self._peers_lock:
            old = self.peers.get(worker)
            if old is not None and old["incarnation"] == meta["incarnation"]:
                return False
            if old is not None:
                del self.peers[worker]
                log.info(
                    "kv peer %s restarted (incarnation %s -> %s)", worker, old["incarnation"], meta["incarnation"]
                )
                self._forget(old)
            self._connect(meta)
            self.peers[worker] = meta
            return True

    def remove_peer(self, worker_id: str) -> None:
        """Drop a peer (it left); later writes to it fail until it is added again."""
        with self._peers_lock:
            old = self.peers.pop(worker_id, None)
            if old is not None:
                self._forget(old)

    def _connect(self, meta: dict[str, Any]) -> None:
        """Prepare to write to a newly added peer (map a segment, load an agent); default: nothing."""
        if self.name not in meta["mechanisms"]:
            raise TransferError(
                self.name, meta["worker_id"], 0, f"peer offers only {sorted(meta['mechanisms'])}"
            )

    def _forget(self, meta: dict[str, Any]) -> None:
        """Release what `_connect` set up for a peer's old incarnation; default: nothing."""
        return None

    def peer(self, worker_id: str) -> dict[str, Any]:
        try:
            return self.peers[worker_id]
        except KeyError:
            raise TransferError(self.name, worker_id, 0, "unknown peer: add_peer(metadata) first") from None

    # ---- transfers ----------------------------------------------------------------------------

    def write(
        self,
        peer_worker_id: str,
        local_blocks: list[int],
        remote_blocks: list[int],
        notify: str,
        layers: tuple[int, int] | None = None,
        deadline: float | None = None,
        incarnation: str | None = None,
        grant: str = "",
    ) -> TransferHandle:
        """Write our `local_blocks` into the peer's `remote_blocks` (pairwise), asynchronously.

        `notify` ("" for none) appears in the peer's `completed()` once these bytes landed.
        `layers` = [first, last) restricts the write to those layers (layer-wise streaming).
        `deadline` is a `time.monotonic()` instant; default now + DEFAULT_TIMEOUT_S.
        `incarnation`, when given, is the peer process the blocks belong to: a peer that has
        restarted under the same worker id since (its block ids mean other things now) is refused.
        `grant` is the peer's token for these blocks (`grant()` on its side, carried in the prefill job):
        an engine that takes writes from the network (TCP) refuses a write without a valid one.
        """
        if self._closed:
            raise TransferError(self.name, peer_worker_id, 0, "engine is closed")
        meta = self.peer(peer_worker_id)
        if incarnation is not None and meta["incarnation"] != incarnation:
            raise TransferError(self.name, peer_worker_id, 0,
                                f"peer restarted: the blocks were {incarnation}'s, the peer is now {meta['incarnation']}")
        self._check_blocks(local_blocks, self.pool.num_blocks, "local")
        self._check_blocks(remote_blocks, meta["num_blocks"], f"{peer_worker_id}'s")
        ranges = byte_ranges(self.pool.layout, local_blocks, remote_blocks, layers)
        nbytes = sum(n for _, _, n in ranges)
        if deadline is None:
            deadline = time.monotonic() + DEFAULT_TIMEOUT_S
        return self._write(meta, ranges, nbytes, notify, deadline, grant)

    def grant(self, blocks: list[int], deadline: float) -> str:
        """A token that lets a peer write into our ``blocks`` until ``deadline`` (epoch seconds): see `WriteGrants`."""
        return self.grants.grant(blocks, deadline)

    def revoke(self, token: str) -> None:
        """End a grant: later writes carrying ``token`` are refused."""
        self.grants.revoke(token)

    @staticmethod
    def _check_blocks(blocks: list[int], num_blocks: int, whose: str) -> None:
        for b in blocks:
            if not 0 <= b < num_blocks:
                raise ValueError(f"block {b} outside {whose} pool of {num_blocks} blocks")

    @abc.abstractmethod
    def _write(
        self,
        meta: dict[str, Any],
        ranges: list[tuple[int, int, int]],
        nbytes: int,
        notify: str,
        deadline: float,
        grant: str,
    ) -> TransferHandle:
        """Start moving `ranges` (local_offset, remote_offset, nbytes) to the peer (``grant``: its token)."""

    def cancel(self, handle: TransferHandle) -> None:
        """Abandon a write (same as handle.cancel()); the peer must quarantine those blocks."""
        handle.cancel()

    def _future_handle(self, peer_worker_id: str, nbytes: int, deadline: float, notify: str) -> FutureHandle:
        """A running FutureHandle for a write done on a worker thread, tracked until it ends."""
        handle = FutureHandle(self.name, peer_worker_id, nbytes, deadline, notify)
        handle.future.set_running_or_notify_cancel()
        self._inflight.add(handle)
        handle.future.add_done_callback(lambda _f: self._inflight.discard(handle))
        return handle

    def mechanism(self, peer_worker_id: str) -> str:
        """The engine that actually moves bytes to this peer (for metrics and logs)."""
        return self.name

    def paths(self) -> dict[str, str]:
        """Every peer this pool writes to, and the mechanism that carries it there (``tandem status``)."""
        return {worker: self.mechanism(worker) for worker in list(self.peers)}

    @abc.abstractmethod
    def completed(self) -> list[str]:
        """Notify tags of writes into our pool that fully landed since the last call."""

    def completion_fds(self) -> list[int]:
        """File descriptors that turn readable when `completed()` may have new tags (wait on them instead
        of polling); reading them is `completed()`'s business."""
        return []

    @property
    def needs_polling(self) -> bool:
        """Whether landings are seen only by calling `completed()` while writes are expected."""
        return False

    def needs_polling_for(self, mechanism: str) -> bool:
        """`needs_polling` for writes a peer sends through ``mechanism`` ('' when not known)."""
        return self.needs_polling

    def close(self) -> None:
        """Release sockets, segments and registrations; idempotent."""
        self._closed = True

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
