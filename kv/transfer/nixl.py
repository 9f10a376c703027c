"""NIXL transfers: one NIXL agent per worker run, the whole pool registered once.

Backend from ``TANDEM_NIXL_BACKEND`` (``ucx`` default, ``libfabric``, ``uccl``). The pool is
registered as DRAM on CPU and VRAM on CUDA. The agent runs without its progress thread: on a
2-core machine that thread costs 2-4x (DESIGN §5); the price is that a transfer moves only while
both sides poll: the writer its handles (`poll()`/`wait()`), the receiver `completed()`
(``get_new_notifs``) in its loop (`needs_polling`) — or pass ``poll_interval`` to have a small thread
poll the receiving side and ring `completion_fds()` when notices came. Agent metadata travels base64 inside `metadata()` (i.e. over NATS), never
through NIXL's own listener.

A write is one NIXL WRITE of the coalesced byte ranges with the notify tag as its notification;
NIXL delivers the notification only after the bytes landed, which is what `completed()` reports.
Tests run with ``UCX_NET_DEVICES=lo`` to keep UCX on loopback.
"""

from __future__ import annotations

import base64
import importlib
import logging
import os
import threading
import time
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kv.pool import KVPool
from kv.transfer.base import TransferEngine
from kv.transfer.doorbell import Doorbell
from kv.transfer.handles import DoneHandle, TransferError, TransferHandle

log = logging.getLogger("kv.transfer.nixl")

BACKENDS = {"ucx": "UCX", "libfabric": "LIBFABRIC", "uccl": "UCCL"}


def _modules() -> tuple[ModuleType, ModuleType]:
    """NIXL's python API: the `nixl` meta package, or the `nixl_cu12` wheel it points to."""
    last: ImportError | None = None
    for pkg in ("nixl", "nixl_cu12", "nixl_cu13"):
        try:
            return importlib.import_module(f"{pkg}._api"), importlib.import_module(f"{pkg}._bindings")
        except ImportError as e:
            last = e
    raise ImportError(f"NIXL is not installed (pip install nixl-cu12): {last}")


def nixl_available() -> bool:
    """True when NIXL's python API imports here."""
    try:
        _modules()
    except ImportError:
        return False
    return True


def backend_name(backend: str | None = None) -> str:
    """NIXL plugin name for TANDEM_NIXL_BACKEND (ucx|libfabric|uccl)."""
    key = (backend or os.environ.get("TANDEM_NIXL_BACKEND") or "ucx").lower()
    if key not in BACKENDS:
        raise ValueError(f"TANDEM_NIXL_BACKEND={key!r}: expected one of {', '.join(BACKENDS)}")
    return BACKENDS[key]


class _NixlHandle(TransferHandle):
    def __init__(self, engine: NixlEngine, xfer: Any, peer: str, nbytes: int, deadline: float, notify: str):
        super().__init__(engine.name, peer, nbytes, deadline, notify)
        self._engine = engine
        self._xfer = xfer

    def _check(self) -> bool:
        eng = self._engine
        try:
            with eng._lock:
                state = eng.agent.check_xfer_state(self._xfer)
        except eng._errors as e:
            self._release()
            raise self.error(f"{type(e).__name__}: {e}") from e
        if state == "DONE":
            self._release()
            return True
        if state == "ERR":
            self._release()
            raise self.error("NIXL reported a transfer error")
        return False

    def _release(self) -> None:
        eng = self._engine
        eng._inflight.discard(self)
        if self._xfer is None:
            return
        xfer, self._xfer = self._xfer, None
        try:
            with eng._lock:
                eng.agent.release_xfer_handle(xfer)
        except eng._errors as e:
            # An active transfer NIXL cannot abort stays with the agent until it is destroyed.
            log.warning("NIXL could not release a transfer to %s: %s", self.peer, e)

    def _abort(self) -> None:
        self._release()


class NixlEngine(TransferEngine):
    """NIXL WRITE with notification, from our registered pool into a peer's registered pool."""

    name = "nixl"

    def __init__(
        self,
        pool: KVPool,
        worker_id: str,
        incarnation: str | None = None,
        backend: str | None = None,
        poll_interval: float | None = None,
    ):
        super().__init__(pool, worker_id, incarnation)
        api, bindings = _modules()
        self._errors: tuple[type[BaseException], ...] = tuple(
            v for v in vars(bindings).values() if isinstance(v, type) and issubclass(v, Exception)
        )
        self.backend = backend_name(backend)
        self.agent_name = f"tandem-{worker_id}-{self.incarnation}"
        config = api.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[self.backend]
        )
        self.agent = api.nixl_agent(self.agent_name, config)
        if self.backend not in self.agent.backends:
            raise RuntimeError(
                f"NIXL backend {self.backend} is unavailable here; plugins: {self.agent.get_plugin_list()}"
            )
        self._lock = threading.RLock()
        self.mem_type = "VRAM" if pool.device.type == "cuda" else "DRAM"
        self.dev_id = pool.device.index or 0
        self._reg = self.agent.register_memory(pool.as_bytes(), backends=[self.backend])
        # A write of no blocks still needs its notification to travel like any other write's
        # (a bare send_notif without progress on our side is dropped by UCX): it writes one
        # meaningless byte of this doorbell into the peer's doorbell.
        self._doorbell = torch.zeros(64, dtype=torch.uint8, device=pool.device)
        self._bell_reg = self.agent.register_memory(self._doorbell, backends=[self.backend])
        self._blob = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self._remote: dict[str, str] = {}
        self._done: list[str] = []
        self._poller: threading.Thread | None = None
        self._wake = Doorbell()  # rung by the poller thread
        if poll_interval is not None:
            self._poller = threading.Thread(
                target=self._poll_loop, args=(poll_interval,), name="kv-nixl-poll", daemon=True
            )
            self._poller.start()

    def _mechanism(self) -> dict[str, Any]:
        return {
            "agent": self.agent_name,
            "blob": self._blob,
            "backend": self.backend,
            "mem": self.mem_type,
            "dev": self.dev_id,
            "base": self.pool.data_ptr(),
            "doorbell": self._doorbell.data_ptr(),
        }

    def _connect(self, meta: dict[str, Any]) -> None:
        super()._connect(meta)
        mech = meta["mechanisms"]["nixl"]
        if mech["backend"] != self.backend:
            raise TransferError(
                self.name,
                meta["worker_id"],
                0,
                f"peer uses NIXL backend {mech['backend']}, we use {self.backend}",
            )
        try:
            with self._lock:
                name = self.agent.add_remote_agent(base64.b64decode(mech["blob"]))
        except self._errors as e:
            raise TransferError(self.name, meta["worker_id"], 0, f"cannot load agent metadata: {e}") from e
        self._remote[meta["worker_id"]] = name.decode() if isinstance(name, bytes) else name

    def _forget(self, meta: dict[str, Any]) -> None:
        name = self._remote.pop(meta["worker_id"], None)
        if name is None:
            return
        try:
            with self._lock:
                self.agent.remove_remote_agent(name)
        except self._errors as e:
            log.info("NIXL could not forget agent %s: %s", name, e)

    def _write(
        self,
        meta: dict[str, Any],
        ranges: list[tuple[int, int, int]],
        nbytes: int,
        notify: str,
        deadline: float,
        grant: str,
    ) -> TransferHandle:
        peer = meta["worker_id"]
        mech = meta["mechanisms"]["nixl"]
        remote = self._remote[peer]
        tag = notify.encode()
        handle: _NixlHandle | None = None
        try:
            if not ranges and not tag:
                return DoneHandle(self.name, peer, 0, notify)
            if ranges:
                local_rows = [(self.pool.data_ptr() + s, n, self.dev_id) for s, _, n in ranges]
                far_rows = [(int(mech["base"]) + d, n, int(mech["dev"])) for _, d, n in ranges]
            else:
                local_rows = [(self._doorbell.data_ptr(), 1, self.dev_id)]
                far_rows = [(int(mech["doorbell"]), 1, int(mech["dev"]))]
            local = np.array(local_rows, dtype=np.uint64)
            far = np.array(far_rows, dtype=np.uint64)
            with self._lock:
                xfer = self.agent.initialize_xfer(
                    "WRITE",
                    self.agent.get_xfer_descs(local, self.mem_type),
                    self.agent.get_xfer_descs(far, mech["mem"]),
                    remote,
                    tag,
                    backends=[self.backend],
                )
                handle = _NixlHandle(self, xfer, peer, nbytes, deadline, notify)
                state = self.agent.transfer(xfer)
        except self._errors as e:
            if handle is not None:  # posted nothing: give the prepared transfer back to the agent
                handle._release()
            raise TransferError(self.name, peer, nbytes, f"{type(e).__name__}: {e}") from e
        if state == "ERR":
            handle._release()
            raise handle.error("NIXL refused to post the transfer")
        self._inflight.add(handle)
        return handle

    def _drain(self) -> None:
        with self._lock:
            notifs = self.agent.get_new_notifs()
            for msgs in notifs.values():
                self._done.extend(m.decode() if isinstance(m, bytes) else m for m in msgs)

    def _poll_loop(self, interval: float) -> None:
        while not self._closed:
            self._drain()
            if self._done:
                self._wake.ring()
            time.sleep(interval)

    @property
    def needs_polling(self) -> bool:
        return self._poller is None

    def completion_fds(self) -> list[int]:
        return [] if self._poller is None else [self._wake.fileno()]

    def completed(self) -> list[str]:
        if self._closed:
            return []
        self._wake.clear()
        self._drain()
        with self._lock:
            tags, self._done = self._done, []
        return tags

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        if self._poller is not None:
            self._poller.join(timeout=2.0)
        self._wake.close()
        for h in list(self._inflight):
            h.cancel()
        for worker in list(self._remote):
            self._forget({"worker_id": worker})
        try:
            with self._lock:
                self.agent.deregister_memory(self._reg, backends=[self.backend])
                self.agent.deregister_memory(self._bell_reg, backends=[self.backend])
        except self._errors as e:
            log.warning("NIXL could not deregister the KV pool: %s", e)
