"""NKey credentials made for one run: a seed file per process, readable by its owner only.

Why NKeys: the server config holds only public keys, so the config file reveals nothing; a
process proves it holds its seed by signing the server's nonce, and no secret crosses the wire.
``nats-py`` (``nkeys_seed``) and the ``nats`` CLI (``--nkey FILE``) read the same seed file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import nkeys

from bus.nats_config import inbox_of


@dataclass(frozen=True)
class NKeyCredential:
    """One process's login: the seed file it connects with, the public key the server knows, its inbox."""

    name: str
    seed_file: Path
    public_key: str

    @property
    def inbox(self) -> str:
        """Its inbox prefix (``TANDEM_NATS_INBOX_PREFIX``): the server lets it read replies there only."""
        return inbox_of(self.name)

    def env(self) -> dict[str, str]:
        """The variables a tandem process reads to log in as this user (``bus.options.BusOptions.from_env``)."""
        return {"TANDEM_NATS_NKEY_SEED": str(self.seed_file), "TANDEM_NATS_INBOX_PREFIX": self.inbox}


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 0600 from the first byte on (never world-readable, not even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def issue_nkey(folder: Path, name: str) -> NKeyCredential:
    """A fresh user NKey named ``name``: its seed written to ``folder/<name>.nk`` (0600)."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    path = folder / f"{name}.nk"
    write_private(path, seed + b"\n")
    return NKeyCredential(name, path, public)
