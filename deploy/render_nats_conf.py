#!/usr/bin/env python3
"""Render the NATS server configs of deploy/ from ``bus.subjects.Subjects.permissions()``.

Why generated: the per-role permissions must be exactly what the workers do, and the code
that spells the subjects is the only source of truth. This script writes

* ``deploy/nats/nats.conf``      one server (Docker Compose), JetStream, monitoring on 8222;
* ``deploy/k8s/nats/nats.conf``  one member of the 3-node JetStream cluster (Kubernetes);

both with the account ``TANDEM`` (JetStream enabled) holding one user per role, and the
system account ``SYS``. Passwords are not in the files: each user's password is a NATS
variable (``$TANDEM_NATS_PASSWORD_<USER>``) that nats-server reads from its environment.
The JetStream store directory is a command-line flag (``-sd /data/jetstream``), so the same
file also runs under ``bus.server.EmbeddedNats``, which passes its own.

    python deploy/render_nats_conf.py            # rewrite both files
    python deploy/render_nats_conf.py --check    # exit 1 if a committed file is stale

``tests/test_deploy.py`` checks that the committed files equal the rendered ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
ROOT = DEPLOY.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: make the repo importable
    sys.path.insert(0, str(ROOT))

from bus.subjects import (  # noqa: E402
    ROLE_DECODE_ONLY,
    ROLE_GATEWAY,
    ROLE_PREFILL_AND_DECODE,
    ROLE_PREFILL_ONLY,
    Subjects,
)
from engine.model_files import DEFAULT_MODEL  # noqa: E402

#: The account every tandem process lives in (KEDA's ``account`` trigger field names it).
ACCOUNT = "TANDEM"
#: The NATS system account (server monitoring over NATS, ``nats server ...``).
SYSTEM_ACCOUNT = "SYS"
CLIENT_PORT = 4222
CLUSTER_PORT = 6222
MONITOR_PORT = 8222
#: Kubernetes: StatefulSet ``nats`` behind the headless Service ``nats``, 3 members.
CLUSTER_NAME = "tandem"
CLUSTER_SIZE = 3
STATEFULSET = "nats"

SINGLE_OUT = DEPLOY / "nats" / "nats.conf"
CLUSTER_OUT = DEPLOY / "k8s" / "nats" / "nats.conf"


@dataclass(frozen=True)
class User:
    """One NATS user: its name, what it is for, and its permissions (None: everything)."""

    name: str
    purpose: str
    permissions: dict[str, list[str]] | None
    allow_responses: bool = False

    @property
    def password_var(self) -> str:
        """The environment variable nats-server reads this user's password from."""
        return f"TANDEM_NATS_PASSWORD_{self.name.upper()}"


def observer_permissions(s: Subjects) -> dict[str, list[str]]:
    """``tandem status`` and ``tandem tail``: read the namespace, ask micro endpoints, read pool backlog."""
    js_read = ["$JS.API.INFO"]
    for stream, consumer in ((s.generate_stream, s.generate_consumer), (s.prefill_stream, s.prefill_consumer)):
        js_read += [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.CONSUMER.INFO.{stream}.{consumer}"]
    return {
        "publish": ["$SRV.>", f"{s.namespace}.svc.*.*", s.autoscale_state, *js_read, "_INBOX.>"],
        "subscribe": [s.all, "$SRV.>", "_INBOX.>"],
    }


def users(s: Subjects) -> list[User]:
    """Every user of the ``TANDEM`` account, one per role (any worker of the role)."""
    return [
        User("admin", "operators and the stream-setup Job: everything in the account", None),
        User("prefill", "tandem serve --pipeline-role prefill_only", s.permissions(ROLE_PREFILL_ONLY), True),
        User("decode", "tandem serve --pipeline-role decode_only", s.permissions(ROLE_DECODE_ONLY), True),
        User("aggregate", "tandem serve --pipeline-role prefill_and_decode",
             s.permissions(ROLE_PREFILL_AND_DECODE), True),
        User("gateway", "tandem gateway", s.permissions(ROLE_GATEWAY), True),
        User("ops", "tandem status, tandem tail (read-only)", observer_permissions(s)),
    ]


def _q(value: str) -> str:
    """A quoted NATS config string (JSON quoting is valid NATS syntax)."""
    return json.dumps(value)


def _subject_list(subjects: list[str], indent: str) -> list[str]:
    seen: list[str] = []
    for subj in subjects:
        if subj not in seen:
            seen.append(subj)
    return [f"{indent}{_q(subj)}" for subj in seen]


def render_accounts(s: Subjects) -> str:
    """The ``accounts`` block and ``system_account`` (shared by both configs)."""
    out = [
        "accounts {",
        f"  {ACCOUNT} {{",
        "    jetstream: enabled",
        "    users: [",
    ]
    for u in users(s):
        out.append(f"      # {u.purpose}")
        out.append("      {")
        out.append(f"        user: {_q(u.name)}")
        out.append(f"        password: ${u.password_var}")
        if u.permissions is not None:
            out.append("        permissions {")
            for verb in ("publish", "subscribe"):
                out.append(f"          {verb} {{")
                out.append("            allow: [")
                out += _subject_list(u.permissions[verb], "              ")
                out.append("            ]")
                out.append("          }")
            if u.allow_responses:
                out.append("          allow_responses: true")
            out.append("        }")
        out.append("      }")
    out += [
        "    ]",
        "  }",
        f"  {SYSTEM_ACCOUNT} {{",
        "    users: [",
        "      # nats server ls / nats server report (system events and server monitoring)",
        "      { user: \"sys\", password: $TANDEM_NATS_PASSWORD_SYS }",
        "    ]",
        "  }",
        "}",
        f"system_account: {SYSTEM_ACCOUNT}",
    ]
    return "\n".join(out) + "\n"


def _header(s: Subjects, what: str) -> str:
    return (
        f"# GENERATED by deploy/render_nats_conf.py from bus/subjects.py: do not edit by hand.\n"
        f"# {what}\n"
        f"# Model {s.model!r}, namespace {s.namespace!r}: streams {s.generate_stream} and {s.prefill_stream},\n"
        f"# consumers {s.generate_consumer} and {s.prefill_consumer}; claims stream {s.claims_stream}.\n"
        f"# Passwords come from the environment of nats-server: "
        + ", ".join(sorted({u.password_var for u in users(s)} | {"TANDEM_NATS_PASSWORD_SYS"}))
        + ".\n\n"
    )


def render_single(s: Subjects) -> str:
    """One server with JetStream (Docker Compose)."""
    return (
        _header(s, "One nats-server with JetStream (deploy/docker-compose.yml).")
        + "server_name: tandem-nats\n"
        f"port: {CLIENT_PORT}\n"
        f"http_port: {MONITOR_PORT}\n"
        "jetstream {\n"
        "  max_memory_store: 256MB\n"
        "  max_file_store: 10GB\n"
        "}\n"
        "lame_duck_duration: \"30s\"\n\n"
        + render_accounts(s)
    )


def render_cluster(s: Subjects, local: LocalMember | None = None) -> str:
    """One member of the 3-node JetStream cluster (Kubernetes StatefulSet ``nats``).

    ``local`` renders the same member for a cluster on one host's loopback (the fault tests): its
    own client, route and monitoring ports, routes to every member's route port, no pid file.
    """
    if local is None:
        route_urls = [f"nats-route://{STATEFULSET}-{i}.{STATEFULSET}:{CLUSTER_PORT}" for i in range(CLUSTER_SIZE)]
        client, cluster, monitor = CLIENT_PORT, CLUSTER_PORT, MONITOR_PORT
        pid_file = "pid_file: \"/var/run/nats/nats.pid\"  # the preStop hook signals lame-duck mode through it\n"
    else:
        route_urls = [f"nats-route://127.0.0.1:{p}" for p in local.route_ports]
        client, cluster, monitor = local.client_port, local.cluster_port, local.monitor_port
        pid_file = ""
    routes = [f"    \"{url}\"" for url in route_urls]
    return (
        _header(s, f"Member of the {CLUSTER_SIZE}-node JetStream cluster (deploy/k8s/nats.yaml); "
                   "POD_NAME names the server.")
        + "server_name: $POD_NAME\n"
        f"port: {client}\n"
        f"http_port: {monitor}\n"
        "jetstream {\n"
        "  max_memory_store: 512MB\n"
        "  max_file_store: 10GB\n"
        "}\n"
        "cluster {\n"
        f"  name: {CLUSTER_NAME}\n"
        f"  port: {cluster}\n"
        "  routes: [\n"
        + "\n".join(routes)
        + "\n  ]\n"
        "}\n"
        "lame_duck_duration: \"30s\"\n"
        + pid_file + "\n"
        + render_accounts(s)
    )


@dataclass(frozen=True)
class LocalMember:
    """The ports of one cluster member on loopback, and every member's route port."""

    client_port: int
    cluster_port: int
    monitor_port: int
    route_ports: tuple[int, ...]


def outputs(model: str = DEFAULT_MODEL, namespace: str = "tandem") -> dict[Path, str]:
    """Every file this script writes, with its content."""
    s = Subjects(model, namespace)
    return {SINGLE_OUT: render_single(s), CLUSTER_OUT: render_cluster(s)}


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, compare) the rendered configs."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"served model (default {DEFAULT_MODEL})")
    p.add_argument("--namespace", default="tandem", help="subject namespace (default tandem)")
    p.add_argument("--check", action="store_true", help="do not write; exit 1 if a committed file differs")
    p.add_argument("--stdout", action="store_true", help="print the single-server config instead of writing")
    args = p.parse_args(argv)
    files = outputs(args.model, args.namespace)
    if args.stdout:
        sys.stdout.write(files[SINGLE_OUT])
        return 0
    stale = [path for path, text in files.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"stale: {path.relative_to(ROOT)} (run python deploy/render_nats_conf.py)", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
