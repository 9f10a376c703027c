"""The folder of one running ``tandem up``: its NATS credentials and server config, and how the
command-line tools on the same machine find them.

Why: ``tandem up``'s embedded NATS admits only the processes of its run. Each process gets its own
NKey (``bus/credentials.py``) and a user narrowed to its own subjects (``bus/nats_config.py``); a
read-only debug user lets a person watch the bus. Everything lives in
``<cache>/run/<pid>/`` (``TANDEM_CACHE_DIR``, default ``~/.cache/tandem``), mode 0700, files 0600,
removed when the run stops. ``tandem status`` and ``tandem tail`` look there for a live run whose
NATS they are pointed at (or, pointed nowhere, the newest live run) and log in as its debug user.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from bus.connection import connect
from bus.credentials import NKeyCredential, issue_nkey, write_private
from bus.nats_config import User, render_embedded, role_user
from bus.options import BusConnectError, BusOptions
from bus.subjects import ROLE_GATEWAY, ROLE_OBSERVER, Subjects

#: the user of ``tandem up`` itself (creates the streams, reads demand for --autoscale): everything in the account
OWNER = "up"
#: the read-only user a person (``nats sub``), ``tandem status`` and ``tandem tail`` log in as
DEBUG = "debug"
RUN_FILE = "run.json"


def runs_root() -> Path:
    """Where the folders of live runs are."""
    from engine.model_cache import cache_dir  # numpy and tokenizers: not for `tandem --help`

    return cache_dir() / "run"


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: not ours to use either
        return False
    return True


@dataclass
class LocalRun:
    """One run's folder: a credential per process, the server config rendered for them, ``run.json``."""

    folder: Path
    credentials: dict[str, NKeyCredential] = field(default_factory=dict)

    @classmethod
    def create(cls, subjects: Subjects, workers: list[tuple[str, str]], gateway_id: str) -> LocalRun:
        """Make the folder and a credential for ``tandem up``, each ``(worker id, role)``, the gateway and
        the debug user; write the embedded server's config. Folders of runs that died are removed."""
        root = runs_root()
        _private_dir(root)
        for stale in root.iterdir():
            if stale.name.isdigit() and not _alive(int(stale.name)):
                shutil.rmtree(stale, ignore_errors=True)
        folder = root / str(os.getpid())
        shutil.rmtree(folder, ignore_errors=True)
        _private_dir(folder)
        run = cls(folder)
        names = [OWNER, *(wid for wid, _ in workers), gateway_id, DEBUG]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must differ from each other and from {OWNER!r}/{DEBUG!r}: {names}")
        run.credentials = {name: issue_nkey(folder, name) for name in names}
        key = {name: c.public_key for name, c in run.credentials.items()}
        users = [User(OWNER, "tandem up itself: creates the streams, reads demand", None, nkey=key[OWNER])]
        users += [role_user(subjects, wid, role, f"tandem serve --pipeline-role {role} --worker-id {wid}",
                            worker_id=wid, nkey=key[wid], create_streams=False) for wid, role in workers]
        users.append(role_user(subjects, gateway_id, ROLE_GATEWAY, f"tandem gateway --gateway-id {gateway_id}",
                               worker_id=gateway_id, nkey=key[gateway_id], create_streams=False))
        users.append(role_user(subjects, DEBUG, ROLE_OBSERVER, "nats sub, tandem status, tandem tail (read-only)",
                               nkey=key[DEBUG]))
        write_private(run.config, render_embedded(subjects, users).encode())
        return run

    @property
    def config(self) -> Path:
        """The embedded nats-server's config (accounts and users; ports come from its flags)."""
        return self.folder / "nats.conf"

    def env(self, name: str) -> dict[str, str]:
        """What process ``name`` needs to log in (its seed file and inbox prefix)."""
        return self.credentials[name].env()

    @property
    def debug(self) -> NKeyCredential:
        """The read-only credential: it can watch everything and publish nothing that acts."""
        return self.credentials[DEBUG]

    def watch_command(self, nats_url: str, namespace: str) -> str:
        """The ``nats`` CLI line that watches the whole namespace as the debug user."""
        return f"nats sub '{namespace}.>' -s {nats_url} --nkey {self.debug.seed_file}"

    def announce(self, nats_url: str, namespace: str) -> None:
        """Write ``run.json``: how the tools on this machine find this run's NATS and debug credential."""
        info = {"pid": os.getpid(), "started": time.time(), "nats_url": nats_url, "namespace": namespace,
                "debug_seed": str(self.debug.seed_file), "debug_inbox": self.debug.inbox}
        tmp = self.folder / f"{RUN_FILE}.tmp"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        write_private(tmp, json.dumps(info).encode())
        os.replace(tmp, self.folder / RUN_FILE)

    def remove(self) -> None:
        """Delete the folder (the run stopped: its credentials mean nothing any more)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def live_runs() -> list[dict[str, Any]]:
    """``run.json`` of every live ``tandem up`` of this user on this machine, newest first."""
    root = runs_root()
    found = []
    if not root.is_dir():
        return found
    for folder in root.iterdir():
        try:
            info = json.loads((folder / RUN_FILE).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and isinstance(info.get("pid"), int) and _alive(info["pid"]):
            found.append(info)
    return sorted(found, key=lambda i: i.get("started", 0.0), reverse=True)


def debug_login(nats_url: str | None) -> dict[str, str] | None:
    """``servers``, ``nkey_seed`` and ``inbox_prefix`` of the live run at ``nats_url`` (None: the newest), if any."""
    for info in live_runs():
        if nats_url is None or _same_server(nats_url, info.get("nats_url", "")):
            return {"servers": info["nats_url"], "nkey_seed": info["debug_seed"], "inbox_prefix": info["debug_inbox"]}
    return None


def _same_server(a: str, b: str) -> bool:
    def norm(url: str) -> str:
        url = url.split(",")[0].strip()
        url = url if "://" in url else f"nats://{url}"
        return url.replace("://localhost:", "://127.0.0.1:")

    return norm(a) == norm(b)


class CliConnectError(Exception):
    """Why a command-line tool could not connect, and the exit code it should end with."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


_CREDENTIAL_ENV = ("TANDEM_NATS_USER", "TANDEM_NATS_TOKEN", "TANDEM_NATS_NKEY_SEED", "TANDEM_NATS_CREDS")


async def connect_for_cli(nats_url: str | None, connect_timeout: float, name: str) -> tuple[Client, BusOptions]:
    """Connect `tandem status` / `tandem tail`: bad options exit 2, no reachable server 1.

    Without credentials in the environment, the debug user of the live ``tandem up`` at that URL
    (``--nats-url``, else ``TANDEM_NATS_URL``, else the newest live run) is used.
    """
    url = nats_url or os.environ.get("TANDEM_NATS_URL") or None
    own = any(os.environ.get(k) for k in _CREDENTIAL_ENV) or "@" in (url or "")  # credentials of one's own
    login = None if own else debug_login(url)
    try:
        opts = BusOptions.from_env(**{"servers": nats_url, **(login or {})}, connect_timeout=connect_timeout)
    except ValueError as e:
        raise CliConnectError(str(e), 2) from e
    try:
        return await connect(opts, name=name), opts
    except BusConnectError as e:
        raise CliConnectError(f"cannot reach NATS: {e}", 1) from e
