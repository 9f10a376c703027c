"""Same-host transfers through POSIX shared memory.

The receiving worker's pool lives in a segment ``/dev/shm/tandem-kv-<worker>-<pid>-<nonce>``
(mode 0600, unlinked on close and at exit). A writer on the same host maps that segment and
copies contiguous byte runs into it with torch (memory bandwidth, no syscall per byte), then
tells the receiver through a unix datagram socket beside the segment (``<segment>.sock``, 0600):
one datagram per write, carrying the notify tag, sent only after the copy finished. Segments and
sockets whose creating pid is dead (a crashed run) are removed whenever a segment is created.

Liveness: during a copy the writer checks that the receiver's pid is alive (not a zombie), and
the final datagram fails when the receiver's socket is gone, so a write to a dead peer raises
TransferError instead of silently landing in an orphaned segment.
"""

from __future__ import annotations

import atexit
import errno
import logging
import mmap
import os
import re
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kv.layout import KVLayout
from kv.pool import KVPool
from kv.transfer.base import TransferEngine
from kv.transfer.handles import FutureHandle, TransferError, TransferHandle
from kv.transfer.ranges import strided_groups

log = logging.getLogger("kv.transfer.shm")

SHM_DIR = "/dev/shm"
PREFIX = "tandem-kv-"
_NAME = re.compile(r"^tandem-kv-(?P<worker>.+)-(?P<pid>\d+)-(?P<nonce>[0-9a-f]{8})(?P<sock>\.sock)?$")
# Copy granularity: between chunks a writer checks cancel, deadline and receiver liveness.
CHUNK_BYTES = 16 << 20

_created: set[str] = set()
_created_lock = threading.Lock()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        log.debug("%s already removed", path)


def _track(path: str, on: bool) -> None:
    with _created_lock:
        if on:
            _created.add(path)
        else:
            _created.discard(path)


def _unlink_created() -> None:
    """atexit: remove every segment and socket this process created and did not close."""
    with _created_lock:
        for path in list(_created):
            _unlink(path)
        _created.clear()


atexit.register(_unlink_created)


def pid_alive(pid: int) -> bool:
    """True if `pid` runs (a killed child its parent has not reaped yet counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def clean_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove tandem segments and sockets left by processes that no longer run; returns their names."""
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if m is None or pid_alive(int(m["pid"])):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except FileNotFoundError:
            continue
        except PermissionError:
            log.warning("stale KV segment %s belongs to another user; left in place", name)
    if removed:
        log.info("removed %d stale KV shm entries: %s", len(removed), ", ".join(sorted(removed)))
    return removed


class ShmSegment:
    """A named shared-memory segment mapped read-write; the creator unlinks it on close."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool):
        self.name = name
        self.size = size
        self.mm = mm
        self.owner = owner
        self.path = os.path.join(SHM_DIR, name)

    @classmethod
    def create(cls, worker_id: str, size: int) -> ShmSegment:
        """Create a fresh 0600 segment of `size` bytes (after cleaning stale ones)."""
        clean_stale()
        safe = re.sub(r"[^A-Za-z0-9_.]", "_", worker_id)[:40] or "worker"
        name = f"{PREFIX}{safe}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        _track(path, True)
        try:
            os.fchmod(fd, 0o600)
            # fallocate, not ftruncate: a full /dev/shm fails here instead of SIGBUS on first touch.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except OSError:
            _unlink(path)
            _track(path, False)
            raise
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> ShmSegment:
        """Map a peer's segment read-write."""
        if not _NAME.match(name):
            raise ValueError(f"not a tandem KV segment name: {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

    def tensor(self) -> torch.Tensor:
        """The segment as a flat uint8 tensor (shares memory)."""
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=self.size)

    def close(self) -> None:
        """For the creator, unlink; the mapping itself goes with its last user.

        Never ``mm.close()``: tensors from ``torch.frombuffer`` view the mapping without holding a
        buffer export, so closing it under a model step or a copy thread would crash the process
        (SIGSEGV). They hold a reference to the mmap object, which unmaps when the last one goes.
        """
        if self.owner:
            _unlink(self.path)
            _track(self.path, False)


def shm_pool(layout: KVLayout, num_blocks: int, worker_id: str) -> tuple[KVPool, ShmSegment]:
    """A KVPool whose storage is a new shared-memory segment (pre-faulted by KVPool)."""
    seg = ShmSegment.create(worker_id, KVPool.bytes_needed(layout, num_blocks))
    return KVPool(layout, num_blocks, buffer=seg.mm), seg


class NotifyInbox:
    """The receiving end of same-host completion notices: a 0600 unix datagram socket."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(path)
        finally:
            os.umask(old)
        _track(path, True)
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> list[str]:
        """Every tag received so far (non-blocking)."""
        tags: list[str] = []
        while True:
            try:
                tags.append(self.sock.recv(65536).decode())
            except (BlockingIOError, InterruptedError):
                return tags

    def close(self) -> None:
        self.sock.close()
        _unlink(self.path)
        _track(self.path, False)


class NotifyOutbox:
    """The sending end: one unbound datagram socket for every peer's inbox."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)

    def try_send(self, path: str, tag: str) -> bool:
        """True once sent, False when the inbox is full (retry); ConnectionError when it is gone."""
        try:
            self.sock.sendto(tag.encode(), path)
            return True
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                raise ConnectionError(f"peer's notification socket {path} is closed") from e
            if e.errno == errno.ENOBUFS:
                return False
            raise

    def close(self) -> None:
        self.sock.close()


class _Peer:
    """A mapped peer segment and the address of its notification socket."""

    def __init__(self, meta: dict[str, Any]):
        mech = meta["mechanisms"]["shm"]
        self.worker = meta["worker_id"]
        self.pid = int(meta["pid"])
        self.sock_path = mech["socket"]
        self.segment = ShmSegment.attach(mech["segment"])
        self.bytes: torch.Tensor | None = self.segment.tensor()

    def close(self) -> None:
        self.bytes = None
        self.segment.close()


class ShmEngine(TransferEngine):
    """Writes by copying into a same-host peer's mapped segment; receives via its own segment."""

    name = "shm"

    def __init__(
        self,
        pool: KVPool,
        worker_id: str,
        incarnation: str | None = None,
        segment: ShmSegment | None = None,
    ):
        """`segment` holds `pool` (the engine then owns it); without one it can write but not receive."""
        super().__init__(pool, worker_id, incarnation)
        if segment is not None and pool.device.type != "cpu":
            raise ValueError("a shm pool lives in host memory")
        self.segment = segment
        self._local = pool.as_bytes()
        self._mapped: dict[str, _Peer] = {}
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-shm")
        self._outbox = NotifyOutbox()
        self._inbox = NotifyInbox(segment.path + ".sock") if segment is not None else None

    def _mechanism(self) -> dict[str, Any]:
        if self.segment is None or self._inbox is None:
            return {"segment": None, "socket": None}
        return {"segment": self.segment.name, "socket": self._inbox.path}

    def _connect(self, meta: dict[str, Any]) -> None:
        super()._connect(meta)
        mech = meta["mechanisms"]["shm"]
        worker = meta["worker_id"]
        if meta["host_id"] != self.host_id:
            raise TransferError(
                self.name, worker, 0, f"peer is on host {meta['host_id']}, we are on {self.host_id}"
            )
        if not mech.get("segment"):
            raise TransferError(self.name, worker, 0, "peer's pool is not in shared memory")
        try:
            self._mapped[worker] = _Peer(meta)
        except OSError as e:
            raise TransferError(self.name, worker, 0, f"cannot map segment {mech['segment']}: {e}") from e

    def _forget(self, meta: dict[str, Any]) -> None:
        peer = self._mapped.pop(meta["worker_id"], None)
        if peer is not None:
            peer.close()

    def _write(
        self,
        meta: dict[str, Any],
        ranges: list[tuple[int, int, int]],
        nbytes: int,
        notify: str,
        deadline: float,
        grant: str,
    ) -> TransferHandle:
        peer = self._mapped[meta["worker_id"]]
        handle = self._future_handle(meta["worker_id"], nbytes, deadline, notify)
        self._thread.submit(self._run, handle, peer, ranges, notify)
        return handle

    def _run(self, h: FutureHandle, peer: _Peer, ranges: list[tuple[int, int, int]], notify: str) -> None:
        try:
            self._copy(h, peer, ranges)
            if notify:
                self._notify(h, peer, notify)
            h.future.set_result(None)
        except TransferError as e:
            h.future.set_exception(e)
        except Exception as e:  # the future must end whatever happened, or the writer would wait
            log.exception("unexpected error in a kv shm write")
            h.future.set_exception(h.error(f"{type(e).__name__}: {e}"))

    def _check_live(self, h: FutureHandle, peer: _Peer) -> None:
        if h.cancelled.is_set():
            raise h.error("cancelled")
        if time.monotonic() > h.deadline:
            raise h.error("deadline passed")
        if not pid_alive(peer.pid):
            raise h.error(f"peer process {peer.pid} is gone")

    def _copy(self, h: FutureHandle, peer: _Peer, ranges: list[tuple[int, int, int]]) -> None:
        if peer.bytes is None:
            raise h.error("peer was removed")
        for s, d, n, count, ss, ds in strided_groups(ranges):
            if count == 1:  # one long run: copy it in CHUNK_BYTES pieces
                done = 0
                while done < n:
                    self._check_live(h, peer)
                    step = min(CHUNK_BYTES, n - done)
                    self._copy_run(peer, s + done, d + done, step, 1, step, step)
                    done += step
                continue
            rows = max(1, CHUNK_BYTES // n)  # many equal ranges: about CHUNK_BYTES of them at a time
            first = 0
            while first < count:
                self._check_live(h, peer)
                k = min(rows, count - first)
                self._copy_run(peer, s + first * ss, d + first * ds, n, k, ss, ds)
                first += k
        self._check_live(h, peer)

    def _copy_run(self, peer: _Peer, s: int, d: int, n: int, count: int, ss: int, ds: int) -> None:
        """Copy `count` ranges of `n` bytes, `ss`/`ds` apart, as one strided torch copy.

        Runs on the engine's thread: torch copies there at 10-15 GB/s on the 2-core VM, while in
        the main thread its 2-thread copy stalls ~8 ms per call (see docs/benchmarks.md).
        """
        assert peer.bytes is not None
        src = self._local[s:].as_strided((count, n), (ss, 1))
        peer.bytes[d:].as_strided((count, n), (ds, 1)).copy_(src)

    def _notify(self, h: FutureHandle, peer: _Peer, notify: str) -> None:
        try:
            while not self._outbox.try_send(peer.sock_path, notify):
                # The receiver's queue is full: it is alive but not draining completed().
                self._check_live(h, peer)
                time.sleep(0.0005)
        except ConnectionError as e:
            raise h.error(str(e)) from e

    def completed(self) -> list[str]:
        return self._inbox.drain() if self._inbox is not None else []

    def completion_fds(self) -> list[int]:
        return [self._inbox.fileno()] if self._inbox is not None else []

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        for h in list(self._inflight):
            h.cancel()
        self._thread.shutdown(wait=True, cancel_futures=True)
        for worker in list(self._mapped):
            self._forget({"worker_id": worker})
        self._outbox.close()
        if self._inbox is not None:
            self._inbox.close()
        if self.segment is not None:
            # The pool tensor still views the mapping; unlinking is what cleanup needs.
            self.segment.close()
