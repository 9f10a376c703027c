"""The one template every nats-server config of tandem is rendered from.

Why one template: the per-role permissions must be exactly what the processes do, and
:meth:`bus.subjects.Subjects.permissions` is the only place that knows that. The same users
block, in account ``TANDEM`` with JetStream, serves

* ``tandem up``'s embedded server: one user per process, authenticated by an NKey made for the
  run (:mod:`bus.credentials`), each narrowed to its own worker or gateway id;
* ``deploy/nats/nats.conf`` (Compose) and ``deploy/k8s/nats/nats.conf`` (one member of the 3-node
  Kubernetes cluster), written by ``deploy/render_nats_conf.py``: one user per role, whose
  password nats-server reads from its environment (``$TANDEM_NATS_PASSWORD_<USER>``);
* the same cluster member on one host's loopback (the fault tests), :class:`LocalMember`.

Each user subscribes to replies under its own inbox prefix only (``_INBOX_<user>``; the process sets
``TANDEM_NATS_INBOX_PREFIX``), so no process reads another's replies: pulled jobs, transfer metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from bus.subjects import ROLE_GATEWAY, ROLE_OBSERVER, Subjects
from runtime.names import ROLE_DECODE_ONLY, ROLE_PREFILL_AND_DECODE, ROLE_PREFILL_ONLY, check_token

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


def password_var(user: str) -> str:
    """The environment variable holding ``user``'s password (nats-server reads it; ``tandem --nats-user`` too)."""
    return f"TANDEM_NATS_PASSWORD_{user.upper().replace('-', '_')}"


def password_vars(users: list[User]) -> list[str]:
    """Every password variable a deploy config with ``users`` reads (the system user ``sys`` included)."""
    return sorted({u.password_var for u in users} | {password_var("sys")})


def inbox_of(user: str) -> str:
    """The inbox prefix of a user: its replies arrive under ``_INBOX_<user>.>`` and nowhere else."""
    return f"_INBOX_{check_token(user, 'NATS user')}"


@dataclass(frozen=True)
class User:
    """One NATS user: its name, what it is for, its permissions (None: everything) and its credential.

    The credential is either ``password_var``, an environment variable of nats-server holding the
    password (deploy/), or ``nkey``, the public half of an NKey whose seed only the process holds
    (``tandem up``).
    """

    name: str
    purpose: str
    permissions: dict[str, list[str]] | None
    allow_responses: bool = False
    nkey: str | None = None

    @property
    def password_var(self) -> str:
        """The environment variable nats-server reads this user's password from (deploy/)."""
        return password_var(self.name)

    @property
    def inbox(self) -> str:
        """Its inbox prefix (``TANDEM_NATS_INBOX_PREFIX`` of the process that logs in as it)."""
        return inbox_of(self.name)


def role_user(s: Subjects, name: str, role: str, purpose: str, *, worker_id: str = "*", nkey: str | None = None,
              create_streams: bool = True) -> User:
    """The user of one role (``worker_id="*"``: any process of it; an id: that process alone)."""
    perms = s.permissions(role, worker_id, inbox=inbox_of(name), create_streams=create_streams)
    return User(name, purpose, perms, allow_responses=role != ROLE_OBSERVER, nkey=nkey)


def deploy_users(s: Subjects) -> list[User]:
    """Every user of the deploy/ configs, one per role (any worker of the role), with passwords."""
    return [
        User("admin", "operators and the stream-setup Job: everything in the account", None),
        role_user(s, "prefill", ROLE_PREFILL_ONLY, "tandem serve --pipeline-role prefill_only"),
        role_user(s, "decode", ROLE_DECODE_ONLY, "tandem serve --pipeline-role decode_only"),
        role_user(s, "aggregate", ROLE_PREFILL_AND_DECODE, "tandem serve --pipeline-role prefill_and_decode"),
        role_user(s, "gateway", ROLE_GATEWAY, "tandem gateway"),
        role_user(s, "ops", ROLE_OBSERVER, "tandem status, tandem tail, nats sub (read-only)"),
    ]


def _q(value: str) -> str:
    """A quoted NATS config string (JSON quoting is valid NATS syntax)."""
    return json.dumps(value)


def _subject_list(subjects: list[str], indent: str) -> list[str]:
    return [f"{indent}{_q(subj)}" for subj in dict.fromkeys(subjects)]


def render_users(users: list[User]) -> list[str]:
    """The ``users: [...]`` entries of the TANDEM account (indented for :func:`render_accounts`)."""
    out: list[str] = []
    for u in users:
        out.append(f"      # {u.purpose}")
        out.append("      {")
        if u.nkey is not None:
            out.append(f"        nkey: {_q(u.nkey)}")
        else:
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
    return out


def render_accounts(users: list[User], system_user: bool = True) -> str:
    """The ``accounts`` block (and ``system_account``) holding ``users`` in account ``TANDEM``.

    ``system_user`` adds the password user ``sys`` of the system account (``nats server ...``);
    without it nats-server makes the system account itself, with nobody in it.
    """
    out = ["accounts {", f"  {ACCOUNT} {{", "    jetstream: enabled", "    users: [", *render_users(users),
           "    ]", "  }"]
    if system_user:
        out += [
            f"  {SYSTEM_ACCOUNT} {{",
            "    users: [",
            "      # nats server ls / nats server report (system events and server monitoring)",
            "      { user: \"sys\", password: $TANDEM_NATS_PASSWORD_SYS }",
            "    ]",
            "  }",
        ]
    out.append("}")
    if system_user:
        out.append(f"system_account: {SYSTEM_ACCOUNT}")
    return "\n".join(out) + "\n"


def _header(s: Subjects, what: str, source: str, credentials: str) -> str:
    return (
        f"# GENERATED by {source} from bus/nats_config.py: do not edit by hand.\n"
        f"# {what}\n"
        f"# Model {s.model!r}, namespace {s.namespace!r}: streams {s.generate_stream} and {s.prefill_stream},\n"
        f"# consumers {s.generate_consumer} and {s.prefill_consumer}; claims stream {s.claims_stream}.\n"
        f"# {credentials}\n\n"
    )


def _passwords(users: list[User]) -> str:
    return f"Passwords come from the environment of nats-server: {', '.join(password_vars(users))}."


def render_single(s: Subjects) -> str:
    """One server with JetStream (Docker Compose)."""
    users = deploy_users(s)
    return (
        _header(s, "One nats-server with JetStream (deploy/docker-compose.yml).", "deploy/render_nats_conf.py",
                _passwords(users))
        + "server_name: tandem-nats\n"
        f"port: {CLIENT_PORT}\n"
        f"http_port: {MONITOR_PORT}\n"
        "jetstream {\n"
        "  max_memory_store: 256MB\n"
        "  max_file_store: 10GB\n"
        "}\n"
        "lame_duck_duration: \"30s\"\n\n"
        + render_accounts(users)
    )


@dataclass(frozen=True)
class ClusterMember:
    """Where one member of the cluster listens, and every member's route URL (its own too: a server skips
    itself). The defaults are the Kubernetes StatefulSet's; the fault tests give loopback ports, the
    emulated hosts and ``tandem nats --cluster`` their machines' addresses."""

    client_port: int = CLIENT_PORT
    cluster_port: int = CLUSTER_PORT
    monitor_port: int = MONITOR_PORT
    routes: tuple[str, ...] = tuple(f"nats-route://{STATEFULSET}-{i}.{STATEFULSET}:{CLUSTER_PORT}"
                                    for i in range(CLUSTER_SIZE))
    #: the preStop hook signals lame-duck mode through it (Kubernetes); "" for none
    pid_file: str = "/var/run/nats/nats.pid"
    #: the address it listens on (clients, routes, monitoring)
    host: str = "0.0.0.0"
    #: what runs the members, for the file's header
    runs_in: str = "deploy/k8s/nats.yaml"


def render_cluster(s: Subjects, member: ClusterMember | None = None) -> str:
    """One member of the 3-node JetStream cluster, with the deploy users (``POD_NAME`` names the server).

    Without ``member``: the Kubernetes StatefulSet ``nats``'s members. The same text, with other ports and
    routes, runs the fault tests' cluster on loopback and the emulated hosts' (``bench/hosts.py``).
    """
    m = member or ClusterMember()
    pid_file = f"pid_file: {_q(m.pid_file)}  # the preStop hook signals lame-duck mode through it\n" \
        if m.pid_file else ""
    routes = [f"    {_q(url)}" for url in m.routes]
    users = deploy_users(s)
    listen = f"listen: {_q(m.host)}\n" if m.host != "0.0.0.0" else ""
    return (
        _header(s, f"Member of the {len(m.routes)}-node JetStream cluster ({m.runs_in}); "
                   "POD_NAME names the server.", "deploy/render_nats_conf.py", _passwords(users))
        + "server_name: $POD_NAME\n"
        + listen
        + f"port: {m.client_port}\n"
        f"http_port: {m.monitor_port}\n"
        "jetstream {\n"
        "  max_memory_store: 512MB\n"
        "  max_file_store: 10GB\n"
        "}\n"
        "cluster {\n"
        f"  name: {CLUSTER_NAME}\n"
        f"  port: {m.cluster_port}\n"
        "  routes: [\n"
        + "\n".join(routes)
        + "\n  ]\n"
        "}\n"
        "lame_duck_duration: \"30s\"\n"
        + pid_file + "\n"
        + render_accounts(users)
    )


def render_embedded(s: Subjects, users: list[User]) -> str:
    """The accounts of ``tandem up``'s embedded server: NKey users only, no password anywhere.

    The port, JetStream store and monitoring come from :class:`bus.server.EmbeddedNats`'s flags.
    """
    return (
        _header(s, "tandem up's embedded nats-server: one NKey user per process of this run.", "tandem up",
                "No passwords: each process proves that it holds its NKey seed (mode 0600 in the run's folder).")
        + render_accounts(users, system_user=False)
    )
