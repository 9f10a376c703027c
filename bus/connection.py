"""Connecting an actor to NATS (how to reach it, credentials and TLS: :mod:`bus.options`): reconnect
and its logging.

Why one place: every process (workers, gateway, CLI) must reach the same NATS the same
way, survive a server restart without a human, and say in its log when the bus went
away and came back. :func:`connect` retries the first connection until
``connect_timeout`` (an authorization failure stops at once), then reconnects forever
with a short, capped backoff and jitter, trying the other members of a cluster before the
one it lost. Pings every second find a member that went silent (a dead host, a cut link)
within two to three seconds, so a client is on another member within about three.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client

from bus.options import BusConnectError, BusOptions, redact_url

log = logging.getLogger("tandem.bus.connection")


def backoff_delay(attempt: int, wait_min: float, wait_max: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before reconnect attempt ``attempt`` (0-based): doubling, capped, ±20 %."""
    base = min(wait_max, wait_min * (2 ** min(attempt, 30)))
    r = rng or random
    return base * r.uniform(0.8, 1.2)


def pick_server(servers: Sequence[Any], lost: str, failures: Mapping[str, int]) -> Any:
    """The server to try next: the one that failed least often since the connection was lost (``failures``
    by ``host:port``), the one lost (``lost``) counting as failed once already, so that a member that died
    or went silent is tried once each of the others was, not first; other ties in the order given."""
    def key(s: Any) -> tuple[int, bool]:
        gone = s.uri.netloc == lost
        return failures.get(s.uri.netloc, 0) + gone, not gone

    return min(servers, key=key)


#: a subject nobody subscribes to: the member itself answers a request there with "no responders"
LINK_CHECK_SUBJECT = "$SRV.PING.tandem-link-check"


async def member_answers(nc: Client, timeout: float) -> bool:
    """Whether the member this client is connected to answers a round trip within ``timeout`` seconds.

    A request nobody subscribes to, which the member answers itself ("no responders"). Not ``flush``: a
    pong that comes after its timeout makes nats-py's reader fail (nats.py issue 624).
    """
    try:
        await nc.request(LINK_CHECK_SUBJECT, b"", timeout=timeout)
    except nats.errors.NoRespondersError:
        return True
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        return False
    except (nats.errors.Error, OSError) as e:  # e.g. closed or reconnecting meanwhile: no proof either way
        log.debug("link check: %r", e)
        return False
    return True


async def force_reconnect(nc: Client, why: str) -> None:
    """Drop the current connection and reconnect (to another member first), as a stale ping would.

    For a client that has evidence of a dead link sooner than its pings do (every peer fell silent at
    once and a ping round trip failed). nats-py has no public call for it; this is its stale-connection path.
    """
    if not nc.is_connected:
        return
    log.warning("nats: %s; dropping the connection to %s to reconnect", why, _url_of(nc))
    await nc._process_op_err(nats.errors.StaleConnectionError())


# Errors that announce a disconnect; the disconnect line reports them.
_DISCONNECT_CAUSES = (nats.errors.UnexpectedEOF, nats.errors.StaleConnectionError, ConnectionError)


def _inbox_hint(err: BaseException, inbox_prefix: str) -> str:
    """What to do when the server refuses this process its own inbox (a locked-down config)."""
    text = str(err)
    if "permissions violation for subscription" not in text.lower() or f"{inbox_prefix}." not in text:
        return ""
    return (f"; this user may not read replies under {inbox_prefix}: set TANDEM_NATS_INBOX_PREFIX to the prefix "
            "the server allows it (tandem's configs give user X the prefix _INBOX_X)")


def _is_permanent_error(err: BaseException) -> bool:
    """Failures that retrying cannot fix: refused credentials, an untrusted certificate."""
    if isinstance(err, (nats.errors.AuthorizationError, ssl.SSLCertVerificationError)):
        return True
    text = str(err).lower()
    return "authorization violation" in text or "authentication" in text


async def connect(
    opts: BusOptions | None = None,
    name: str = "tandem",
    *,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
) -> Client:
    """Connect to NATS with ``opts`` (default: from the environment) as client ``name``.

    The first connection is retried until ``opts.connect_timeout``; a refused
    authorization fails at once with :class:`BusConnectError`. Once connected, the
    client reconnects forever (exponential backoff, jitter, resubscribing), logging one
    line per disconnect, reconnect, error, discovered server and lame-duck notice.
    ``on_disconnect``/``on_reconnect`` are optional async callables (no arguments) run
    after the log line, e.g. to mark an actor not ready.
    """
    opts = opts or BusOptions.from_env()
    kwargs = opts.connect_kwargs()
    open_remote = opts.unauthenticated_remote()
    if open_remote:
        log.warning("nats %s: connecting to %s without credentials: whoever reaches that server reads and writes "
                    "tandem's subjects (set TANDEM_NATS_USER/PASSWORD, _NKEY_SEED or _CREDS: docs/operations.md, "
                    "Security)", name, ", ".join(open_remote))
    nc = Client()
    connected = asyncio.Event()
    first_error: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
    last_error: list[BaseException] = []

    # "netloc": host:port of the member connected to; "lost": the one the last disconnect left
    # "failures": per host:port, failed attempts since; "tried": the one the last attempt went to
    state: dict[str, Any] = {"url": "?", "down_since": None, "netloc": "", "lost": "", "failures": {}, "tried": ""}

    async def error_cb(err: Exception) -> None:
        last_error[:] = [err]
        if not connected.is_set():
            if _is_permanent_error(err) and not first_error.done():
                first_error.set_result(err)
            log.debug("nats %s: connect attempt failed: %r", name, err)
        elif (nc.is_connected and not isinstance(err, _DISCONNECT_CAUSES)) or _is_permanent_error(err):
            log.warning("nats %s: error: %r%s", name, err, _inbox_hint(err, opts.inbox_prefix))
        else:
            # the cause of a disconnect, or a failed reconnect attempt: the disconnect and
            # reconnect lines tell the story, so these stay at debug
            log.debug("nats %s: %r", name, err)

    async def disconnected_cb() -> None:
        if not connected.is_set() or nc.is_closed:
            return
        state["down_since"] = time.monotonic()
        state["lost"], state["failures"], state["tried"] = state["netloc"], {}, ""
        cause = f" ({last_error[0]!r})" if last_error else ""
        log.warning("nats %s: disconnected from %s%s; reconnecting", name, state["url"], cause)
        if on_disconnect is not None:
            await on_disconnect()

    async def reconnected_cb() -> None:
        state["url"], state["netloc"] = _url_of(nc), _netloc_of(nc)
        since = state["down_since"]
        down = f" after {time.monotonic() - since:.1f}s" if since is not None else ""
        state["down_since"] = None
        last_error.clear()
        log.warning("nats %s: reconnected to %s%s", name, state["url"], down)
        if on_reconnect is not None:
            await on_reconnect()

    async def closed_cb() -> None:
        if connected.is_set():
            log.info("nats %s: connection closed", name)

    async def discovered_server_cb() -> None:
        log.info("nats %s: discovered servers %s", name, [redact_url(u) for u in _server_urls(nc)])

    async def lame_duck_cb() -> None:
        log.warning("nats %s: server %s entered lame-duck mode; will move to another", name, _url_of(nc))

    def choose_server(servers: list[Any], info: dict[str, Any]) -> tuple[Any, float]:
        failures = state["failures"]
        if state["tried"]:  # asked again: the last attempt failed
            failures[state["tried"]] = failures.get(state["tried"], 0) + 1
        target = pick_server(servers, state["lost"], failures)
        state["tried"] = target.uri.netloc
        delay = backoff_delay(failures.get(target.uri.netloc, 0), opts.reconnect_wait_min, opts.reconnect_wait_max)
        log.debug("nats %s: reconnecting to %s in %.2fs", name, redact_url(target.uri.geturl()), delay)
        return target, delay

    connect_task = asyncio.ensure_future(
        nc.connect(
            **kwargs,
            name=name,
            error_cb=error_cb,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            closed_cb=closed_cb,
            discovered_server_cb=discovered_server_cb,
            lame_duck_mode_cb=lame_duck_cb,
            reconnect_to_server_handler=choose_server,
            allow_reconnect=True,
            dont_randomize=True,  # the order given is the preference (own member first)
            max_reconnect_attempts=-1,
            reconnect_time_wait=opts.reconnect_wait_min,  # type: ignore[arg-type]  # first-connect retry pace
            connect_timeout=min(opts.attempt_timeout, opts.connect_timeout),  # type: ignore[arg-type]
            ping_interval=opts.ping_interval,  # type: ignore[arg-type]
            max_outstanding_pings=opts.max_outstanding_pings,
            pending_size=opts.reconnect_buffer,
        )
    )
    done, _ = await asyncio.wait(
        {connect_task, first_error}, timeout=opts.connect_timeout, return_when=asyncio.FIRST_COMPLETED
    )
    if connect_task in done:
        first_error.cancel()
        try:
            connect_task.result()
        except (nats.errors.Error, OSError, asyncio.TimeoutError) as e:
            await _abandon(nc, name)
            raise BusConnectError(f"cannot connect {name!r} to NATS at {opts.display_servers}: {e!r}") from e
        connected.set()
        state["url"], state["netloc"] = _url_of(nc), _netloc_of(nc)
        last_error.clear()
        log.info("nats %s: connected to %s (max_payload %d)", name, _url_of(nc), nc.max_payload)
        return nc
    connect_task.cancel()
    with contextlib.suppress(asyncio.CancelledError, nats.errors.Error, OSError):
        await connect_task
    await _abandon(nc, name)
    if first_error in done:
        err = first_error.result()
        raise BusConnectError(f"NATS at {opts.display_servers} refused {name!r}: {err}") from err
    first_error.cancel()
    why = f": last error {last_error[0]!r}" if last_error else ""
    raise BusConnectError(
        f"no NATS server reachable at {opts.display_servers} within {opts.connect_timeout:.1f}s{why}"
    )


async def _abandon(nc: Client, name: str, deadline: float = 2.0) -> None:
    """Close a connection that never came up, within a deadline.

    A TLS server that drops a handshake it refused (no client certificate) can leave the SSL transport's
    close waiter unresolved, so an unbounded close would turn a refusal into a hang.
    """
    try:
        await asyncio.wait_for(nc.close(), deadline)
    except asyncio.TimeoutError:
        log.debug("nats %s: closing the failed connection took over %.1fs; left to the loop", name, deadline)
    except (nats.errors.Error, OSError) as e:
        log.debug("nats %s: closing the failed connection: %r", name, e)


def _url_of(nc: Client) -> str:
    url = nc.connected_url
    return redact_url(url.geturl()) if url is not None else "?"


def _netloc_of(nc: Client) -> str:
    url = nc.connected_url
    return url.netloc if url is not None else ""


def _server_urls(nc: Client) -> Sequence[str]:
    return [u.geturl() for u in getattr(nc, "discovered_servers", []) or []]
