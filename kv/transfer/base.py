"""The one interface every KV transfer engine implements (`TransferEngine`), and the ids its metadata carries.

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
``auto`` lists all of its sub-engines (see `kv.transfer.auto`). What a write copies is a list of
byte ranges (`kv.transfer.ranges`); a write in flight is a `kv.transfer.handles.TransferHandle`.
"""

from __future__ import annotations

import abc
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from kv.layout import KVLayout, LayoutMismatch
from kv.pool import KVPool
from kv.transfer.grants import WriteGrants
from kv.transfer.handles import DEFAULT_TIMEOUT_S, FutureHandle, TransferError, TransferHandle
from kv.transfer.ranges import byte_ranges

log = logging.getLogger("kv.transfer")


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
