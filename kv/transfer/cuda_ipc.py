"""Same-host GPU-to-GPU transfers with CUDA IPC handles (CuPy), device-to-device copies.

The receiver exports a CUDA IPC handle (``cupy.cuda.runtime.ipcGetMemHandle``) of the device
allocation that holds its pool, plus the pool's offset inside that allocation (PyTorch's caching
allocator may place the pool inside a larger segment; `torch.cuda.memory_snapshot` tells which).
A writer opens the handle once per peer incarnation (``ipcOpenMemHandle``), wraps it as a torch
tensor through DLPack and copies byte runs on a side stream that first waits for the current
stream (so the KV it just computed is complete). When the copy's CUDA event has completed the
writer sends the notify tag through the same-host datagram inbox that shm uses.

CuPy is imported lazily: without it or without a GPU the engine reports itself unavailable
(`cuda_ipc_available()`), and `auto` does not offer it. The expandable-segments allocator mode
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) does not support these IPC handles.
"""

from __future__ import annotations

import base64
import logging
import os
import uuid
from typing import Any

import torch

from kv.pool import KVPool
from kv.transfer.base import TransferEngine
from kv.transfer.handles import DoneHandle, TransferError, TransferHandle
from kv.transfer.shm import SHM_DIR, NotifyInbox, NotifyOutbox, pid_alive

log = logging.getLogger("kv.transfer.cuda_ipc")


def cuda_ipc_available() -> bool:
    """True when CuPy imports and a CUDA device is usable."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.cuda.is_available())


def _allocation_of(ptr: int, device: int) -> tuple[int, int]:
    """(base address, size) of the caching-allocator segment holding `ptr`."""
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", device) != device:
            continue
        base, size = int(seg["address"]), int(seg["total_size"])
        if base <= ptr < base + size:
            return base, size
    raise RuntimeError(f"device pointer {ptr:#x} is not in a PyTorch caching-allocator segment")


class _CudaHandle(TransferHandle):
    def __init__(
        self,
        engine: CudaIpcEngine,
        event: Any,
        peer: dict[str, Any],
        nbytes: int,
        deadline: float,
        notify: str,
    ):
        super().__init__(engine.name, peer["worker_id"], nbytes, deadline, notify)
        self._engine = engine
        self._event = event
        self._peer = peer
        self._copied = False

    def _check(self) -> bool:
        if not self._copied:
            if not self._event.query():
                return False
            self._copied = True
        if not pid_alive(int(self._peer["pid"])):
            raise self.error(f"peer process {self._peer['pid']} is gone")
        if not self.notify:
            return True
        try:
            return self._engine._outbox.try_send(self._peer["mechanisms"]["cuda_ipc"]["socket"], self.notify)
        except ConnectionError as e:
            raise self.error(str(e)) from e

    def _abort(self) -> None:
        # A queued device copy cannot be recalled; the peer quarantines the blocks (DESIGN §4).
        return None


class CudaIpcEngine(TransferEngine):
    """Device-to-device copies into a same-host peer's pool opened through a CUDA IPC handle."""

    name = "cuda_ipc"

    def __init__(self, pool: KVPool, worker_id: str, incarnation: str | None = None):
        super().__init__(pool, worker_id, incarnation)
        if pool.device.type != "cuda":
            raise ValueError("cuda_ipc needs a CUDA pool")
        import cupy  # lazily: CPU-only installs never need it

        self._cupy = cupy
        self.dev = pool.device.index if pool.device.index is not None else torch.cuda.current_device()
        base, size = _allocation_of(pool.data_ptr(), self.dev)
        with cupy.cuda.Device(self.dev):
            handle = cupy.cuda.runtime.ipcGetMemHandle(base)
        self._ipc = {
            "handle": base64.b64encode(bytes(handle)).decode(),
            "offset": pool.data_ptr() - base,
            "size": size,
            "dev": self.dev,
        }
        self._local = pool.as_bytes()
        self._stream = torch.cuda.Stream(device=self.dev)
        self._opened: dict[str, tuple[int, torch.Tensor]] = {}
        self._outbox = NotifyOutbox()
        self._inbox = NotifyInbox(
            os.path.join(SHM_DIR, f"tandem-kv-cuda-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock")
        )

    def _mechanism(self) -> dict[str, Any]:
        return {**self._ipc, "socket": self._inbox.path}

    def _connect(self, meta: dict[str, Any]) -> None:
        super()._connect(meta)
        worker = meta["worker_id"]
        if meta["host_id"] != self.host_id:
            raise TransferError(
                self.name, worker, 0, f"peer is on host {meta['host_id']}, we are on {self.host_id}"
            )
        mech = meta["mechanisms"]["cuda_ipc"]
        cupy = self._cupy
        try:
            with cupy.cuda.Device(self.dev):
                ptr = cupy.cuda.runtime.ipcOpenMemHandle(base64.b64decode(mech["handle"]))  # lazy peer access
                mem = cupy.cuda.UnownedMemory(ptr, int(mech["size"]), owner=self, device_id=self.dev)
                arr = cupy.ndarray(
                    (int(mech["size"]),), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0)
                )
                whole = torch.from_dlpack(arr)
        except cupy.cuda.runtime.CUDARuntimeError as e:
            raise TransferError(self.name, worker, 0, f"cannot open the peer's IPC handle: {e}") from e
        off = int(mech["offset"])
        view = whole[off : off + int(meta["num_blocks"]) * self.pool.block_bytes]
        self._opened[worker] = (ptr, view)

    def _forget(self, meta: dict[str, Any]) -> None:
        opened = self._opened.pop(meta["worker_id"], None)
        if opened is None:
            return
        ptr, _view = opened
        torch.cuda.synchronize(self.dev)
        try:
            with self._cupy.cuda.Device(self.dev):
                self._cupy.cuda.runtime.ipcCloseMemHandle(ptr)
        except self._cupy.cuda.runtime.CUDARuntimeError as e:
            log.info("closing the IPC handle of %s failed: %s", meta["worker_id"], e)

    def _write(
        self,
        meta: dict[str, Any],
        ranges: list[tuple[int, int, int]],
        nbytes: int,
        notify: str,
        deadline: float,
        grant: str,
    ) -> TransferHandle:
        _, dst = self._opened[meta["worker_id"]]
        if not ranges and not notify:
            return DoneHandle(self.name, meta["worker_id"], 0, notify)
        self._stream.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(self._stream):
            for s, d, n in ranges:
                dst[d : d + n].copy_(self._local[s : s + n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return _CudaHandle(self, event, meta, nbytes, deadline, notify)

    def completed(self) -> list[str]:
        return self._inbox.drain()

    def completion_fds(self) -> list[int]:
        return [self._inbox.fileno()]

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        for worker in list(self._opened):
            self._forget({"worker_id": worker})
        self._outbox.close()
        self._inbox.close()
