"""What ``tandem up`` tells once the cluster is ready: the table on the terminal and the ready file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from runtime.placement import available_cpus, format_cpus
from tandem.up.cluster import Cluster
from tandem.up.plan import Plan


def describe_scaling(plan: Plan) -> str:
    assert plan.autoscale is not None
    return "; ".join(f"{role} {p.min}..{p.max} (target {p.target:g} per worker, activation {p.activation:g})"
                     for role, p in plan.autoscale.items())


def announce(cluster: Cluster, plan: Plan, url: str, nats_url: str, kernels: dict[str, str]) -> None:
    """The ready table; `kernels`: each worker's matmul path (engine.native.kernel_path), as /ready lists it."""
    body = json.dumps({"model": plan.served_name,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    cluster.say(f"tandem is up: model {plan.served_name}")
    cluster.say(f"  page        {url}/   (chat in the browser, and a live view of the cluster)")
    cluster.say(f"  OpenAI API  {url}/v1")
    if cluster.run is not None:
        cluster.say(f"  NATS        {nats_url}   (every process logs in with its own NKey; strangers are refused)")
        cluster.say(f"  watch       {cluster.run.watch_command(nats_url, plan.namespace)}   (read-only; "
                    "tandem status / tandem tail use it too)")
    else:
        cluster.say(f"  NATS        {nats_url}   (watch: nats sub '{plan.namespace}.>' -s {nats_url})")
    if cluster.nats is not None and cluster.nats.monitor_url:
        cluster.say(f"  monitoring  {cluster.nats.monitor_url}/jsz?consumers=true   (what KEDA's scaler reads)")
    for m in cluster.members:
        where = f"metrics :{m.metrics_port}" if m.metrics_port else f"metrics {url}/metrics"
        place = plan.placements[m.name].describe() if m.name in plan.placements else "any core"
        if kernels.get(m.name):
            place += f", kernels {kernels[m.name]}"
        cluster.say(f"  {m.name:<14} {m.role:<19} pid {m.child.pid:<8} {where:<15} {place}")
    if plan.autoscale is not None:
        cluster.say(f"  autoscale   {describe_scaling(plan)}; metrics "
                    f"{url.rsplit(':', 1)[0]}:{plan.autoscale_metrics_port}/metrics")
    cluster.say(f"  placement   {plan.placement_note}; NATS and the gateway are light and run on any core "
                f"({format_cpus(available_cpus())})")
    if plan.defaults:
        cluster.say(f"  defaults    {plan.defaults}   (a request's own values win; --default-max-tokens, "
                    "--default-temperature, ...)")
    cluster.say("Try:")
    auth = " -H \"Authorization: Bearer $TANDEM_API_KEY\"" if os.environ.get("TANDEM_API_KEYS") else ""
    cluster.say(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
    if auth:
        cluster.say("  (API keys are on: set TANDEM_API_KEY to one of TANDEM_API_KEYS)")
    cluster.say("A child that dies is restarted; Ctrl-C stops everything.")


def write_ready_file(path: Path, cluster: Cluster, plan: Plan, url: str, nats_url: str) -> None:
    info = {
        "url": url,
        "base_url": f"{url}/v1",
        "nats_url": nats_url,
        "model": plan.served_name,
        "namespace": plan.namespace,
        "pid": os.getpid(),
        "nats_pid": cluster.nats.pid if cluster.nats is not None else None,
        "nats_store": cluster.nats.store_dir if cluster.nats is not None else None,
        # the read-only debug login of our own NATS (None when joining one): nats-py's nkeys_seed, inbox_prefix
        "nats_debug_seed": str(cluster.run.debug.seed_file) if cluster.run is not None else None,
        "nats_debug_inbox": cluster.run.debug.inbox if cluster.run is not None else None,
        "autoscale_metrics": (f"{url.rsplit(':', 1)[0]}:{plan.autoscale_metrics_port}/metrics"
                              if plan.autoscale is not None else None),
        "children": [{"name": m.name, "role": m.role, "pid": m.child.pid, "metrics_port": m.metrics_port,
                      "restarts": cluster.restarts(m.name),
                      "placement": plan.placements[m.name].describe() if m.name in plan.placements else ""}
                     for m in cluster.members],
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, path)
