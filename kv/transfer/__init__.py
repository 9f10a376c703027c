"""KV transfer plane: write KV blocks from one worker's pool into another worker's pool.

Engines (`TANDEM_KV_TRANSFER`): ``shm`` (same host, POSIX shared memory), ``tcp`` (plain
sockets), ``nixl`` (NIXL agent, `TANDEM_NIXL_BACKEND`), ``cuda_ipc`` (same-host GPUs, CuPy) and
``auto`` (one pool reachable by all of them; each peer gets the fastest common one, see
`kv.transfer.auto`). The interface is `kv.transfer.base.TransferEngine`; descriptors and
metadata travel over NATS, which this package never imports.
"""

from kv.transfer.auto import ENGINE_KINDS, AutoEngine, choose_engine, create_engine
from kv.transfer.base import TransferEngine, host_id, new_incarnation
from kv.transfer.handles import DEFAULT_TIMEOUT_S, TransferError, TransferHandle
from kv.transfer.ranges import byte_ranges

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENGINE_KINDS",
    "AutoEngine",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "byte_ranges",
    "choose_engine",
    "create_engine",
    "host_id",
    "new_incarnation",
]
