"""How a process reaches NATS: servers, credentials, TLS and inbox prefix (:class:`BusOptions`, read from
``TANDEM_NATS_*``), and the variables that log it in as one of tandem's NATS users (:func:`user_login`)."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from bus.nats_config import inbox_of, password_var
from bus.subjects import DEFAULT_INBOX
from runtime.names import check_token

DEFAULT_URL = "nats://127.0.0.1:4222"


_SCHEMES = ("nats", "tls", "ws", "wss")


def _check_server_url(url: str) -> None:
    """ValueError (secrets left out) unless ``url`` is ``scheme://host[:port]`` with a known scheme, or host:port."""
    shown = redact_url(url)
    try:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        port = parts.port
    except ValueError as e:
        raise ValueError(f"bad NATS URL {shown}: {e}") from None
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"bad NATS URL {shown}: the scheme must be one of {', '.join(_SCHEMES)}")
    if not parts.hostname:
        raise ValueError(f"bad NATS URL {shown}: no host")
    if port == 0:
        raise ValueError(f"bad NATS URL {shown}: port 0")


class BusConnectError(ConnectionError):
    """The first connection to NATS failed (no server before the deadline, or refused)."""


def redact_url(url: str) -> str:
    """A server URL with any password/token replaced, safe to log."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    cred = f"{user}:***" if parts.password is not None else "***"
    return urlunsplit((parts.scheme, f"{cred}@{host}", parts.path, parts.query, parts.fragment))


@dataclass(frozen=True)
class BusOptions:
    """How to reach NATS.

    ``servers`` is a list of URLs (a cluster: any member will do), tried in that order: put the member on
    this process's machine first; after a failure the others come before the one lost. Authentication is
    one of user/password, token, an NKey seed file or a ``.creds`` file (JWT + seed);
    NKey and creds need the ``nkeys`` package. ``tls_ca`` verifies the server;
    ``tls_cert``/``tls_key`` present a client certificate (mutual TLS).
    """

    servers: tuple[str, ...] = (DEFAULT_URL,)
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    nkey_seed: str | None = None
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_hostname: str | None = None
    #: Where replies to this process arrive (``<prefix>.<unique>``): a server that locks each user
    #: to its own prefix (bus/nats_config.py) keeps other processes from reading them.
    inbox_prefix: str = DEFAULT_INBOX
    #: Deadline for the first connection (seconds); afterwards reconnects never stop.
    connect_timeout: float = 30.0
    #: Reconnect backoff: first wait, cap. Each failed attempt at a server doubles its wait (±20 % jitter);
    #: the cap is short so that a member back after an outage is found within about a second.
    reconnect_wait_min: float = 0.1
    reconnect_wait_max: float = 1.0
    #: One connection attempt (TCP, TLS, CONNECT): a member behind a cut link costs this much, not more.
    attempt_timeout: float = 2.0
    #: Client→server pings: a silent member is given up after ``interval × (outstanding + 1)`` at most.
    ping_interval: float = 1.0
    max_outstanding_pings: int = 2
    #: Bytes buffered while reconnecting before publishes fail.
    reconnect_buffer: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        servers = tuple(self.servers.split(",")) if isinstance(self.servers, str) else tuple(self.servers)
        servers = tuple(s.strip() for s in servers if s and s.strip())
        if not servers:
            raise ValueError("BusOptions.servers is empty: give at least one nats:// URL")
        for url in servers:
            _check_server_url(url)
        object.__setattr__(self, "servers", servers)
        if self.tls_key and not self.tls_cert:
            raise ValueError("tls_key given without tls_cert")
        check_token(self.inbox_prefix, "TANDEM_NATS_INBOX_PREFIX")

    @property
    def silent_after(self) -> float:
        """Seconds after which a silent member is given up at the latest (the pings' deadline)."""
        return self.ping_interval * (self.max_outstanding_pings + 1)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> BusOptions:
        """Read ``TANDEM_NATS_*`` variables (``TANDEM_NATS_URL`` is a comma-separated list).

        Keyword overrides that are not None (e.g. from command-line flags) win.
        """
        e = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = e.get(name)
            return value if value else None

        url = get("TANDEM_NATS_URL") or DEFAULT_URL
        opts = cls(
            servers=tuple(u.strip() for u in url.split(",") if u.strip()),
            user=get("TANDEM_NATS_USER"),
            password=get("TANDEM_NATS_PASSWORD"),
            token=get("TANDEM_NATS_TOKEN"),
            nkey_seed=get("TANDEM_NATS_NKEY_SEED"),
            creds=get("TANDEM_NATS_CREDS"),
            tls_ca=get("TANDEM_NATS_TLS_CA"),
            tls_cert=get("TANDEM_NATS_TLS_CERT"),
            tls_key=get("TANDEM_NATS_TLS_KEY"),
            inbox_prefix=get("TANDEM_NATS_INBOX_PREFIX") or DEFAULT_INBOX,
            ping_interval=_positive(get("TANDEM_NATS_PING_INTERVAL"), "TANDEM_NATS_PING_INTERVAL", 1.0),
        )
        changes = {k: v for k, v in overrides.items() if v is not None}
        if isinstance(changes.get("servers"), str):
            changes["servers"] = tuple(u.strip() for u in changes["servers"].split(",") if u.strip())
        return replace(opts, **changes) if changes else opts

    @property
    def authenticated(self) -> bool:
        """Whether any credential is set (a certificate counts: the server may map it to a user)."""
        return any((self.user, self.token, self.nkey_seed, self.creds, self.tls_cert))

    def unauthenticated_remote(self) -> list[str]:
        """Servers off this machine that this process would reach without any credential (redacted)."""
        if self.authenticated:
            return []
        out = []
        for url in self.servers:
            host = urlsplit(url if "://" in url else f"nats://{url}").hostname or ""
            if not _is_loopback(host):
                out.append(redact_url(url))
        return out

    @property
    def display_servers(self) -> str:
        """The server list with secrets removed, for logs and errors."""
        return ", ".join(redact_url(s) for s in self.servers)

    def tls_context(self) -> ssl.SSLContext | None:
        """An SSL context when any TLS file is set (or a ``tls://`` URL is used), else None."""
        wants_tls = any(s.startswith("tls://") for s in self.servers)
        if not (self.tls_ca or self.tls_cert or wants_tls):
            return None
        for label, path in (("TLS CA", self.tls_ca), ("TLS cert", self.tls_cert), ("TLS key", self.tls_key)):
            if path and not Path(path).is_file():
                raise BusConnectError(f"{label} file {path!r} does not exist")
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` carrying servers, credentials and TLS."""
        kw: dict[str, Any] = {"servers": list(self.servers), "inbox_prefix": self.inbox_prefix}
        if self.user is not None:
            kw["user"] = self.user
        if self.password is not None:
            kw["password"] = self.password
        if self.token is not None:
            kw["token"] = self.token
        if self.nkey_seed or self.creds:
            if importlib.util.find_spec("nkeys") is None:
                raise BusConnectError(
                    "NKey/creds authentication needs the 'nkeys' package (pip install nkeys)"
                )
            for label, path in (("NKey seed", self.nkey_seed), ("creds", self.creds)):
                if path and not Path(path).is_file():
                    raise BusConnectError(f"{label} file {path!r} does not exist")
        if self.nkey_seed:
            kw["nkeys_seed"] = self.nkey_seed
        if self.creds:
            kw["user_credentials"] = self.creds
        tls = self.tls_context()
        if tls is not None:
            kw["tls"] = tls
            if self.tls_hostname:
                kw["tls_hostname"] = self.tls_hostname
        return kw


def _positive(value: str | None, name: str, default: float) -> float:
    if value is None:
        return default
    try:
        out = float(value)
    except ValueError:
        out = 0.0
    if not out > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return out


def user_login(user: str, env: Mapping[str, str]) -> dict[str, str]:
    """The variables that log a process in as NATS ``user`` of tandem's configs (``tandem --nats-user``).

    The password is ``TANDEM_NATS_PASSWORD``, else the server's own variable for that user,
    ``TANDEM_NATS_PASSWORD_<USER>`` (what ``tandem nats --make-passwords`` writes); the inbox prefix
    is the user's (``_INBOX_<user>``) unless ``TANDEM_NATS_INBOX_PREFIX`` says otherwise.
    """
    check_token(user, "--nats-user")
    var = password_var(user)
    password = env.get("TANDEM_NATS_PASSWORD") or env.get(var)
    if not password:
        raise ValueError(f"--nats-user {user}: set {var} (or TANDEM_NATS_PASSWORD), e.g. with --env-file")
    return {"TANDEM_NATS_USER": user, "TANDEM_NATS_PASSWORD": password,
            "TANDEM_NATS_INBOX_PREFIX": env.get("TANDEM_NATS_INBOX_PREFIX") or inbox_of(user)}


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False
