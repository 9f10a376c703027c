"""Which writes a pool accepts from the network: per-attempt write grants, and the mechanisms that check them."""

from __future__ import annotations

import secrets
import threading
import time

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
