"""``tandem nats``: one embedded nats-server in the foreground until Ctrl-C, alone or as a member of a
JetStream cluster (its config rendered from bus/nats_config.py); and the users' passwords for a cluster."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bus.server import EmbeddedNats, NatsServerError


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``tandem nats`` flags (the CLI may pass its own sub-parser to fill)."""
    p = parser or argparse.ArgumentParser(prog="tandem nats", description="Run an embedded nats-server -js.")
    p.add_argument("--port", type=int, default=4222, help="client port (0 = any free port; default 4222)")
    p.add_argument("--host", default=None,
                   help="address to bind (default 127.0.0.1; with --cluster 0.0.0.0, every address)")
    p.add_argument("--store-dir", default=None, help="JetStream store directory (default: a temporary one)")
    p.add_argument("--config", default=None, help="nats-server config file (accounts, permissions, cluster; default: none, an open server)")
    p.add_argument("--max-payload", type=int, default=None, help="max message size in bytes (default 1 MiB)")
    p.add_argument("--nats-monitor-port", "--monitor-port", dest="monitor_port", type=int, default=None,
                   help="serve NATS monitoring (/varz, /jsz: what KEDA's JetStream scaler reads) on this port "
                        "(default: off; 8222 with --cluster)")
    p.add_argument("--cluster", default=None, metavar="ROUTE,ROUTE,...",
                   help="join a JetStream cluster: every member's route URL, this one's too, e.g. "
                        "nats-route://10.0.0.1:6222,nats-route://10.0.0.2:6222,nats-route://10.0.0.3:6222. "
                        "Renders the member's config from bus/nats_config.py with the deploy users, whose "
                        "passwords it reads from TANDEM_NATS_PASSWORD_<USER> (default: a lone server)")
    p.add_argument("--cluster-port", type=int, default=6222, help="with --cluster: the route port (default 6222)")
    p.add_argument("--server-name", default=None, help="with --cluster: this member's name (default: the hostname)")
    p.add_argument("--model", default=None, help="with --cluster: the served model, whose streams the users may "
                                                  "use (default: the built-in model)")
    p.add_argument("--namespace", default=None, help="with --cluster: the subject namespace (default tandem)")
    p.add_argument("--make-passwords", action="store_true",
                   help="print a random password for every user of tandem's configs, as TANDEM_NATS_PASSWORD_<USER>="
                        "lines for an --env-file that every machine shares, and exit (default: off)")
    return p


def make_passwords() -> str:
    """``TANDEM_NATS_PASSWORD_<USER>=<random>`` for every user of the deploy configs (and ``sys``)."""
    import secrets

    from bus.nats_config import deploy_users, password_vars
    from bus.subjects import Subjects

    names = password_vars(deploy_users(Subjects("any")))
    # nats-server reads a variable's value as config: one that starts with a digit would be taken for a number
    return "".join(f"{name}=p{secrets.token_hex(20)}\n" for name in names)


def cluster_config(args: argparse.Namespace, folder: Path) -> tuple[Path, dict[str, str]]:
    """``tandem nats --cluster``: the member's config (written into ``folder``, 0600) and the server's environment.

    Raises NatsServerError naming every password variable that is not set.
    """
    from bus.nats_config import ClusterMember, deploy_users, password_vars, render_cluster
    from bus.subjects import Subjects
    from engine.model_files import DEFAULT_MODEL, model_name

    routes = tuple(r.strip() for r in args.cluster.split(",") if r.strip())
    if len(routes) < 2 or not all(r.startswith("nats-route://") for r in routes):
        raise NatsServerError(f"--cluster wants every member's nats-route://HOST:PORT, comma-separated; got "
                              f"{args.cluster!r}")
    subjects = Subjects(model_name(args.model or DEFAULT_MODEL), args.namespace or "tandem")
    missing = [v for v in password_vars(deploy_users(subjects)) if not os.environ.get(v)]
    if missing:
        raise NatsServerError(f"--cluster: set the users' passwords first ({', '.join(missing)}): every member and "
                              "every client of the cluster must agree on them (docs/operations.md, three machines)")
    member = ClusterMember(client_port=args.port, cluster_port=args.cluster_port,
                           monitor_port=args.monitor_port or 8222, routes=routes, pid_file="", host=args.host)
    path = folder / "tandem-cluster.conf"
    path.write_text(render_cluster(subjects, member))
    os.chmod(path, 0o600)
    return path, {**os.environ, "POD_NAME": args.server_name or socket.gethostname()}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one embedded nats-server in the foreground until Ctrl-C / SIGTERM."""
    return run(build_parser().parse_args(list(argv) if argv is not None else None))


def run(args: argparse.Namespace) -> int:
    """`main` for already-parsed flags (the `tandem nats` sub-command)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.make_passwords:
        sys.stdout.write("# tandem NATS users' passwords: copy this file to every machine (tandem --env-file)\n"
                         + make_passwords())
        return 0
    args.host = args.host or ("0.0.0.0" if args.cluster else "127.0.0.1")
    folder = tempfile.TemporaryDirectory(prefix="tandem-nats-conf-")
    config, env = args.config, None
    if args.cluster:
        if args.config:
            print("error: --cluster renders its own config; drop --config", file=sys.stderr, flush=True)
            return 2
        try:
            path, env = cluster_config(args, Path(folder.name))
        except NatsServerError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        config = str(path)
    srv = EmbeddedNats(
        port=None if args.cluster else args.port,  # the rendered config holds the ports and the address
        store_dir=args.store_dir,
        config=config,
        max_payload=args.max_payload,
        host=args.host,
        echo=True,
        monitor_port=None if args.cluster else args.monitor_port,
        server_name=args.server_name if args.cluster else None,
        env=env,
    )

    def _on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _on_term)
    try:
        srv.start()
        monitor = f", monitoring {srv.monitor_url}" if srv.monitor_url else ""
        print(f"nats-server ready at {srv.url} (JetStream store {srv.store_dir}{monitor}); Ctrl-C to stop", flush=True)
        while True:
            rc = srv.wait(timeout=0.5)
            if rc is not None:
                print(f"nats-server exited on its own with code {rc}", file=sys.stderr, flush=True)
                return rc
    except KeyboardInterrupt:
        print("stopping nats-server", file=sys.stderr, flush=True)
        return 0
    except NatsServerError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        srv.stop()
        folder.cleanup()
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
