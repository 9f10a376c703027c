"""Plain TCP transfers, for hosts without NIXL (and as the last resort of ``auto``).

The receiver listens (127.0.0.1 by default; pass ``host="0.0.0.0"`` and ``advertise_host`` for
other machines) and serves each connection in a background thread. A write is one frame:

    u32 header length | header JSON {"id", "incarnation", "grant", "ranges": [[offset, nbytes], ...],
                                     "notify"} | the ranges' bytes, in order

The receiver reads the bytes straight into its pool (``recv_into`` a view of the pool), records
``notify`` for `completed()` and answers ``u32 length | {"id", "ok", "error"}``; the writer's
handle is done on that ack. A frame is drained and refused, before a byte lands, unless its
``grant`` is a live token this pool made for exactly the blocks it writes (`WriteGrants`: the decode
worker makes one per prefill attempt and sends it in the prefill job, which only processes
logged in to NATS read; it is revoked when the attempt ends), its incarnation is this pool's (the
receiver restarted on the same port) and its ranges lie in the pool. Nothing else authenticates
the connection, and the bytes are not encrypted: across machines, use a network you trust or NIXL.
Each writer keeps one connection per peer and
sends its writes to that peer in order on one thread; a failure closes the connection (the next
write reconnects), so a half-sent frame never gets confused with the next one.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kv.pool import KVPool
from kv.transfer.base import TransferEngine
from kv.transfer.doorbell import Doorbell
from kv.transfer.handles import FutureHandle, TransferHandle

log = logging.getLogger("kv.transfer.tcp")

_LEN = struct.Struct("!I")
CHUNK_BYTES = 4 << 20
# A sender that stops mid-frame frees the receiver's connection thread after this long.
FRAME_STALL_S = 60.0
MAX_HEADER = 64 << 20


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """n bytes, or None on a clean EOF before the first byte."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_msg(sock: socket.socket) -> dict[str, Any] | None:
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_HEADER:
        raise ConnectionError(f"frame header of {n} bytes is too large")
    body = _recv_exact(sock, n)
    if body is None:
        raise ConnectionError("connection closed inside a frame header")
    return json.loads(body)


class WriteRefused(Exception):
    """The receiver took the frame and refused it (no grant, another incarnation, outside the pool)."""


class _Peer:
    """One writer-side connection to a peer; writes to it run in order on one thread."""

    def __init__(self, meta: dict[str, Any]):
        mech = meta["mechanisms"]["tcp"]
        self.worker = meta["worker_id"]
        self.incarnation = meta["incarnation"]
        self.addr = (mech["host"], int(mech["port"]))
        self.sock: socket.socket | None = None
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-tcp-{self.worker}")
        self.closed = False

    def drop(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:  # wakes a sendall blocked on a peer that stopped reading
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                log.debug("kv tcp connection to %s already down", self.worker)
            sock.close()

    def close(self) -> None:
        """Writes still queued run at once and fail (their handles must end, not wait out their deadline)."""
        self.closed = True
        self.thread.shutdown(wait=False)
        self.drop()


class TcpEngine(TransferEngine):
    """Length-prefixed frames over TCP; the receiver writes into its blocks and acks."""

    name = "tcp"

    def __init__(
        self,
        pool: KVPool,
        worker_id: str,
        incarnation: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
    ):
        super().__init__(pool, worker_id, incarnation)
        self._bytes = pool.as_bytes()
        self._cpu_view = memoryview(self._bytes.numpy()) if pool.device.type == "cpu" else None
        self._done: list[str] = []
        self._done_lock = threading.Lock()
        self._bell = Doorbell()
        self._conns: set[socket.socket] = set()
        self._peers: dict[str, _Peer] = {}
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.settimeout(0.25)
        self.host = advertise_host or (host if host not in ("0.0.0.0", "") else socket.gethostname())
        self.port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True)
        self._acceptor.start()

    def _mechanism(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port}

    # ---- receiving ----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed:
                    return
                raise
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._closed:
                conn.settimeout(None)
                header = _recv_msg(conn)
                if header is None:
                    return
                conn.settimeout(FRAME_STALL_S)
                error = self._receive(conn, header)
                if not error and header.get("notify"):
                    with self._done_lock:
                        self._done.append(header["notify"])
                    self._bell.ring()
                _send_msg(conn, {"id": header.get("id"), "ok": not error, "error": error})
        except (OSError, ValueError, KeyError, TypeError) as e:
            # The writer died or gave up mid-frame: its handle fails there; nothing lands here.
            if not self._closed:
                log.info("kv tcp connection dropped: %s", e)
        finally:
            self._conns.discard(conn)
            conn.close()

    def _receive(self, conn: socket.socket, header: dict[str, Any]) -> str:
        """Read the frame's bytes into the pool; returns an error text ('' when all landed)."""
        ranges = [(int(o), int(n)) for o, n in header["ranges"]]
        error = ""
        if header.get("incarnation") != self.incarnation:
            error = f"frame for incarnation {header.get('incarnation')}, this pool is {self.incarnation}"
        elif any(o < 0 or n < 0 or o + n > self.pool.nbytes for o, n in ranges):
            error = f"frame ranges outside the pool of {self.pool.nbytes} bytes"
        else:
            error = self.grants.refusal(str(header.get("grant") or ""), ranges)
        if error:
            log.warning("kv tcp: refused a write of %d bytes: %s", sum(n for _, n in ranges), error)
        if error:
            scratch = bytearray(CHUNK_BYTES)
            left = sum(n for _, n in ranges)
            while left:
                k = conn.recv_into(scratch, min(left, CHUNK_BYTES))
                if k == 0:
                    raise ConnectionError("connection closed while draining a refused frame")
                left -= k
            return error
        for off, n in ranges:
            self._recv_range(conn, off, n)
        return ""

    def _recv_range(self, conn: socket.socket, off: int, n: int) -> None:
        if self._cpu_view is not None:
            view = self._cpu_view[off : off + n]
            got = 0
            while got < n:
                k = conn.recv_into(view[got:], n - got)
                if k == 0:
                    raise ConnectionError(f"connection closed after {got} of {n} bytes")
                got += k
            return
        staging = bytearray(min(n, CHUNK_BYTES))
        got = 0
        while got < n:
            step = min(len(staging), n - got)
            data = _recv_exact(conn, step)
            if data is None:
                raise ConnectionError(f"connection closed after {got} of {n} bytes")
            self._bytes[off + got : off + got + step].copy_(
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
            )
            got += step

    def completed(self) -> list[str]:
        self._bell.clear()
        with self._done_lock:
            tags, self._done = self._done, []
        return tags

    def completion_fds(self) -> list[int]:
        return [self._bell.fileno()]

    # ---- writing ------------------------------------------------------------------------------

    def _connect(self, meta: dict[str, Any]) -> None:
        super()._connect(meta)
        self._peers[meta["worker_id"]] = _Peer(meta)

    def _forget(self, meta: dict[str, Any]) -> None:
        peer = self._peers.pop(meta["worker_id"], None)
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
        peer = self._peers[meta["worker_id"]]
        handle = self._future_handle(meta["worker_id"], nbytes, deadline, notify)
        peer.thread.submit(self._run, handle, peer, ranges, notify, grant)
        return handle

    def _run(self, h: FutureHandle, peer: _Peer, ranges: list[tuple[int, int, int]], notify: str,
             grant: str) -> None:
        try:
            if peer.closed:
                raise ConnectionAbortedError(f"peer {peer.worker} {peer.incarnation} was removed (left or restarted)")
            self._send(h, peer, ranges, notify, grant)
            h.future.set_result(None)
        except TimeoutError as e:
            peer.drop()
            h.future.set_exception(h.error(f"peer {peer.addr} stalled past the deadline ({e})"))
        except WriteRefused as e:  # the peer read the whole frame and said no: the connection is still in step
            h.future.set_exception(h.error(f"the peer refused the write: {e}"))
        except (OSError, ValueError) as e:
            peer.drop()
            h.future.set_exception(h.error(f"connection to {peer.addr} lost: {type(e).__name__}: {e}"))
        except Exception as e:  # the future must end whatever happened, or the writer would wait
            peer.drop()
            h.future.set_exception(h.error(f"{type(e).__name__}: {e}"))
            log.exception("unexpected error in a kv tcp write")

    def _left(self, h: FutureHandle) -> float:
        if h.cancelled.is_set():
            raise ConnectionAbortedError("cancelled")
        left = h.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        return left

    def _send(self, h: FutureHandle, peer: _Peer, ranges: list[tuple[int, int, int]], notify: str,
              grant: str) -> None:
        if peer.sock is None:
            sock = socket.create_connection(peer.addr, timeout=self._left(h))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer.sock = sock
        sock = peer.sock
        header = {
            "id": id(h),
            "incarnation": peer.incarnation,
            "grant": grant,
            "ranges": [[d, n] for _, d, n in ranges],
            "notify": notify,
        }
        sock.settimeout(self._left(h))
        _send_msg(sock, header)
        for s, _, n in ranges:
            done = 0
            while done < n:
                step = min(CHUNK_BYTES, n - done)
                sock.settimeout(self._left(h))
                sock.sendall(self._source(s + done, step))
                done += step
        sock.settimeout(self._left(h))
        reply = _recv_msg(sock)
        if reply is None:
            raise ConnectionError("peer closed the connection before acknowledging")
        if not reply.get("ok"):
            raise WriteRefused(str(reply.get("error")))

    def _source(self, off: int, n: int) -> memoryview | bytes:
        if self._cpu_view is not None:
            return self._cpu_view[off : off + n]
        return self._bytes[off : off + n].cpu().numpy().tobytes()

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        for h in list(self._inflight):
            h.cancel()
        for worker in list(self._peers):
            self._forget({"worker_id": worker})
        self._listener.close()
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                log.debug("connection already closed")
        self._acceptor.join(timeout=2.0)
        self._bell.close()
