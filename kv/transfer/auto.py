"""Engine factory and ``auto``: one pool that every peer can reach by its fastest common path.

A worker must allocate its pool before it knows its peers, so ``auto`` allocates the pool where
the most mechanisms can reach it and serves them all at once over that one pool:

- CPU: the pool lives in shared memory (`ShmEngine` receives there), the same memory is
  registered with a NIXL agent (if NIXL imports) and a TCP listener serves it too;
- CUDA: a device pool exported by CUDA IPC (if CuPy and a GPU are there), registered with NIXL
  (VRAM), and a TCP listener (staged through host memory) as the last resort.

Its metadata lists every mechanism; when a peer is added, `choose_engine` picks the fastest
mechanism both sides support, logs the choice, and every write to that peer goes through it:

- same host, both pools on GPUs: cuda_ipc, then nixl, then tcp;
- same host, CPU: shm, then nixl, then tcp (measured here, 2 cores, default model's KV of a
  2048-token prompt between two processes: shm ~7 GB/s, nixl ~5.5 GB/s, tcp ~4 GB/s — see
  docs/benchmarks.md; shm also lands while the receiver is busy, where NIXL waits for it to poll);
- other hosts: nixl, then tcp.

`completed()` merges the notices of all sub-engines and `completion_fds()` their wake-up descriptors,
so the receiving side waits on one object.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kv.layout import KVLayout
from kv.pool import KVPool
from kv.transfer.base import TransferEngine, device_kind
from kv.transfer.handles import TransferError, TransferHandle

log = logging.getLogger("kv.transfer")

ENGINE_KINDS = ("auto", "nixl", "shm", "tcp", "cuda_ipc")

SAME_HOST_GPU = ("cuda_ipc", "nixl", "tcp")
SAME_HOST_CPU = ("shm", "nixl", "tcp")
OTHER_HOST = ("nixl", "tcp")


def _usable(mech: str, ours: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """Whether `mech` can carry a write from `ours` into `theirs` (both metadata dicts)."""
    if mech not in ours["mechanisms"] or mech not in theirs["mechanisms"]:
        return False
    same_host = ours["host_id"] == theirs["host_id"]
    fields = theirs["mechanisms"][mech]
    if mech == "shm":
        return same_host and bool(fields.get("segment")) and theirs["device"] == "cpu"
    if mech == "cuda_ipc":
        return same_host and ours["device"] == "cuda" and theirs["device"] == "cuda"
    if mech == "nixl":
        return fields.get("backend") == ours["mechanisms"]["nixl"].get("backend")
    return True


def choose_engine(local_meta: dict[str, Any], peer_meta: dict[str, Any]) -> str:
    """The fastest mechanism that carries our writes into the peer's pool; TransferError if none."""
    same_host = local_meta["host_id"] == peer_meta["host_id"]
    if same_host and local_meta["device"] == "cuda" and peer_meta["device"] == "cuda":
        order = SAME_HOST_GPU
    elif same_host:
        order = SAME_HOST_CPU
    else:
        order = OTHER_HOST
    for mech in order:
        if _usable(mech, local_meta, peer_meta):
            return mech
    raise TransferError(
        "auto",
        peer_meta["worker_id"],
        0,
        f"no common engine: we offer {sorted(local_meta['mechanisms'])} on {local_meta['host_id']} "
        f"({local_meta['device']}), the peer {sorted(peer_meta['mechanisms'])} on {peer_meta['host_id']} "
        f"({peer_meta['device']})",
    )


class AutoEngine(TransferEngine):
    """Several engines over one pool; each peer is served by the engine `choose_engine` picks."""

    name = "auto"

    def __init__(self, pool: KVPool, worker_id: str, incarnation: str, engines: list[TransferEngine],
                 nixl_missing: str = ""):
        super().__init__(pool, worker_id, incarnation)
        self.engines = {e.name: e for e in engines}
        for e in engines:  # one pool: a grant made here covers a write through whichever engine receives it
            e.grants = self.grants
        self.choice: dict[str, str] = {}
        self.nixl_missing = nixl_missing  # why NIXL is not among the engines ("" when it is, or was not tried)

    def mechanisms(self) -> dict[str, dict[str, Any]]:
        merged: dict[str, dict[str, Any]] = {}
        for engine in self.engines.values():
            merged.update(engine.mechanisms())
        return merged

    def _mechanism(self) -> dict[str, Any]:
        return {}

    def _connect(self, meta: dict[str, Any]) -> None:
        try:
            mech = choose_engine(self.metadata(), meta)
        except TransferError as e:
            if self.nixl_missing and "nixl" in meta["mechanisms"]:  # NIXL would have been the path to this peer
                log.warning("kv transfer to %s needs NIXL, which is unavailable here (%s): pip install nixl-cu12",
                            meta["worker_id"], self.nixl_missing)
                raise TransferError("auto", meta["worker_id"], 0, f"{e.reason}; NIXL would reach it but is "
                                    f"unavailable here ({self.nixl_missing}): pip install nixl-cu12") from e
            raise
        self.engines[mech].add_peer(meta)
        self.choice[meta["worker_id"]] = mech
        log.info(
            "kv transfer %s -> %s via %s (same host: %s, peer device: %s, peer offers %s)",
            self.worker_id,
            meta["worker_id"],
            mech,
            meta["host_id"] == self.host_id,
            meta["device"],
            ", ".join(sorted(meta["mechanisms"])),
        )

    def _forget(self, meta: dict[str, Any]) -> None:
        mech = self.choice.pop(meta["worker_id"], None)
        if mech is not None:
            self.engines[mech].remove_peer(meta["worker_id"])

    def _write(
        self,
        meta: dict[str, Any],
        ranges: list[tuple[int, int, int]],
        nbytes: int,
        notify: str,
        deadline: float,
        grant: str,
    ) -> TransferHandle:
        return self.engines[self.choice[meta["worker_id"]]]._write(meta, ranges, nbytes, notify, deadline, grant)

    def mechanism(self, peer_worker_id: str) -> str:
        return self.choice.get(peer_worker_id, self.name)

    def completed(self) -> list[str]:
        tags: list[str] = []
        for mech, engine in self.engines.items():
            try:  # one engine's failure must not lose the notices the others already handed over
                tags.extend(engine.completed())
            except Exception:
                log.exception("kv %s engine: reading completion notices failed", mech)
        return tags

    def completion_fds(self) -> list[int]:
        return [fd for engine in self.engines.values() for fd in engine.completion_fds()]

    @property
    def needs_polling(self) -> bool:
        return any(engine.needs_polling for engine in self.engines.values())

    def needs_polling_for(self, mechanism: str) -> bool:
        engine = self.engines.get(mechanism)
        return engine.needs_polling if engine is not None else self.needs_polling

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        for engine in self.engines.values():
            engine.close()


def create_engine(
    kind: str,
    layout: KVLayout,
    num_blocks: int,
    device: str | torch.device,
    worker_id: str,
    incarnation: str | None = None,
    tcp_host: str = "127.0.0.1",
    tcp_advertise_host: str | None = None,
    nixl_backend: str | None = None,
    nixl_poll_interval: float | None = None,
) -> TransferEngine:
    """Allocate a pool where engine `kind` needs it (shm: a shared segment) and build the engine.

    `kind` is TANDEM_KV_TRANSFER: auto|nixl|shm|tcp|cuda_ipc. The engine owns the pool's memory
    and releases it on close().
    """
    from kv.transfer.base import new_incarnation
    from kv.transfer.shm import ShmEngine, shm_pool
    from kv.transfer.tcp import TcpEngine

    incarnation = incarnation or new_incarnation()
    dev = torch.device(device)
    on_gpu = device_kind(dev) == "cuda"

    def tcp(pool: KVPool) -> TcpEngine:
        return TcpEngine(pool, worker_id, incarnation, host=tcp_host, advertise_host=tcp_advertise_host)

    def nixl(pool: KVPool) -> TransferEngine:
        from kv.transfer.nixl import NixlEngine

        return NixlEngine(
            pool, worker_id, incarnation, backend=nixl_backend, poll_interval=nixl_poll_interval
        )

    if kind == "shm":
        if on_gpu:
            raise ValueError("the shm engine serves host-memory pools; use cuda_ipc, nixl or auto on GPUs")
        pool, seg = shm_pool(layout, num_blocks, worker_id)
        return ShmEngine(pool, worker_id, incarnation, segment=seg)
    if kind == "tcp":
        return tcp(KVPool(layout, num_blocks, dev))
    if kind == "nixl":
        return nixl(KVPool(layout, num_blocks, dev))
    if kind == "cuda_ipc":
        from kv.transfer.cuda_ipc import CudaIpcEngine, cuda_ipc_available

        if not on_gpu or not cuda_ipc_available():
            raise RuntimeError("cuda_ipc needs CuPy (pip install cupy-cuda12x) and a CUDA device pool")
        return CudaIpcEngine(KVPool(layout, num_blocks, dev), worker_id, incarnation)
    if kind != "auto":
        raise ValueError(f"unknown KV transfer engine {kind!r}; expected one of {', '.join(ENGINE_KINDS)}")

    engines: list[TransferEngine] = []
    if on_gpu:
        from kv.transfer.cuda_ipc import CudaIpcEngine, cuda_ipc_available

        pool = KVPool(layout, num_blocks, dev)
        if cuda_ipc_available():
            engines.append(CudaIpcEngine(pool, worker_id, incarnation))
    else:
        pool, seg = shm_pool(layout, num_blocks, worker_id)
        engines.append(ShmEngine(pool, worker_id, incarnation, segment=seg))
    missing = ""
    try:
        engines.append(nixl(pool))
    except Exception as e:  # any NIXL failure (plugin, UCX) leaves the other mechanisms working
        missing = str(e)
        # not a warning: shm (same host) and TCP serve every peer; it becomes one where NIXL is the only path
        log.info("auto: NIXL unavailable (%s); same-host peers use shm, others TCP (pip install nixl-cu12 for NIXL)",
                 e)
    engines.append(tcp(pool))
    return AutoEngine(pool, worker_id, incarnation, engines, missing)
