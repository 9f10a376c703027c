#!/usr/bin/env python3
"""Write the NATS server configs of deploy/, rendered by ``bus/nats_config.py`` (the template
``tandem up``'s embedded server is rendered from too).

Why generated: the per-role permissions must be exactly what the workers do, and the code
that spells the subjects is the only source of truth. This script writes

* ``deploy/nats/nats.conf``      one server (Docker Compose), JetStream, monitoring on 8222;
* ``deploy/nats/cluster.conf``   one member of the 3-node JetStream cluster of Compose's profile
  ``cluster`` (services nats, nats-2, nats-3);
* ``deploy/k8s/nats/nats.conf``  one member of the 3-node JetStream cluster (Kubernetes);

all with the account ``TANDEM`` (JetStream enabled) holding one user per role, and the
system account ``SYS``. Passwords are not in the files: each user's password is a NATS
variable (``$TANDEM_NATS_PASSWORD_<USER>``) that nats-server reads from its environment, and
each process sets ``TANDEM_NATS_INBOX_PREFIX=_INBOX_<user>`` (its replies arrive there only).
The JetStream store directory is a command-line flag (``-sd /data/jetstream``), so the same
file also runs under ``bus.server.EmbeddedNats``, which passes its own.

    python deploy/render_nats_conf.py            # rewrite the files
    python deploy/render_nats_conf.py --check    # exit 1 if a committed file is stale

``tests/test_deploy.py`` checks that the committed files equal the rendered ones.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
ROOT = DEPLOY.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: make the repo importable
    sys.path.insert(0, str(ROOT))

from bus.nats_config import CLUSTER_PORT, ClusterMember, render_cluster, render_single  # noqa: E402
from bus.subjects import Subjects  # noqa: E402
from engine.model_files import DEFAULT_MODEL  # noqa: E402

SINGLE_OUT = DEPLOY / "nats" / "nats.conf"
COMPOSE_CLUSTER_OUT = DEPLOY / "nats" / "cluster.conf"
CLUSTER_OUT = DEPLOY / "k8s" / "nats" / "nats.conf"
#: the NATS services of docker-compose.yml's profile ``cluster`` (``nats`` is the single server's too)
COMPOSE_MEMBERS = ("nats", "nats-2", "nats-3")


def outputs(model: str = DEFAULT_MODEL, namespace: str = "tandem") -> dict[Path, str]:
    """Every file this script writes, with its content."""
    s = Subjects(model, namespace)
    compose = ClusterMember(routes=tuple(f"nats-route://{name}:{CLUSTER_PORT}" for name in COMPOSE_MEMBERS),
                            pid_file="", runs_in="deploy/docker-compose.yml, profile cluster")
    return {SINGLE_OUT: render_single(s), COMPOSE_CLUSTER_OUT: render_cluster(s, compose),
            CLUSTER_OUT: render_cluster(s)}


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
