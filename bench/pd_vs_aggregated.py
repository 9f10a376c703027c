"""Experiment 1 of issue 10: prefill/decode split against aggregated serving on the same two cores.

    python -m bench.pd_vs_aggregated [--rates 0.25,0.5,1] [--duration 60] [--write]
    python -m bench.pd_vs_aggregated --local-prefill-max-tokens 0,32,64,128,256 [--stall-budget-ms 50]

Each layout is a fresh ``tandem up`` measured by ``tandem bench`` under ``mixed`` load — short
chats (``--input-len`` tokens in, ``--output-len`` out) with an evenly spaced ``--long-share`` of
``--long-tokens``-token prompts — at increasing Poisson rates:

- ``disaggregated``: ``tandem up``'s default on two cores: 1 decode worker on the second core, 1 prefill
  worker on both (two threads, at idle priority, so on the second core only while decode idles);
- ``disaggregated-pinned``: 1 prefill worker on the first core only, 1 decode worker on the second, one
  torch thread each (the default before prefill borrowed the decode core);
- ``aggregated-512`` / ``aggregated-128``: one prefill_and_decode worker on both cores, step
  token budget 512 or 128 (``--max-step-tokens``);
- ``aggregated-2x``: two prefill_and_decode workers, one per core.

``--local-prefill-max-tokens A,B,...`` sweeps that floor of conditional disaggregation instead:
one ``disaggregated-lp<N>`` layout per value (``--layouts`` picks others to add), to set its
default from measurements.

It reports, per layout and rate, the short requests' ITL p99, TTFT p90 of short and long
requests, and goodput at the SLOs (default TTFT ≤ 3 s, ITL ≤ 150 ms), and checks the issue's
targets: at the first rate where ``aggregated-512``'s short ITL p99 passes the ITL SLO,
disaggregated's should be at most 0.25× of it, and its goodput at least 2×. The load generator
shares the two cores with the server, so figures measured on a busy machine are indicative.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.cluster import TandemUp
from runtime.placement import available_cpus


def layouts(floors: list[int] | None = None, stall_budget_ms: float | None = None) -> dict[str, list[str]]:
    """``tandem up`` flags of each layout, on this machine's first two cores; with ``floors``, one
    disaggregated layout per ``--local-prefill-max-tokens`` value."""
    first, second = available_cpus()[:2]
    split = ["--prefill-cpus", f"{first},{second}", "--decode-cpus", str(second)]  # tandem up's default on 2 cores
    budget = "" if stall_budget_ms is None else f" --prefill-stall-budget-ms {stall_budget_ms:g}"
    sweep = {f"disaggregated-lp{n}": [*split, "--worker-args", f"--local-prefill-max-tokens {n}{budget}"]
             for n in floors or []}
    return {
        **sweep,
        "disaggregated": split,
        "disaggregated-pinned": ["--prefill-cpus", str(first), "--decode-cpus", str(second)],
        "aggregated-512": ["--aggregated", "--decode-cpus", f"{first},{second}", "--worker-args",
                           "--max-step-tokens 512"],
        "aggregated-128": ["--aggregated", "--decode-cpus", f"{first},{second}", "--worker-args",
                           "--max-step-tokens 128"],
        "aggregated-2x": ["--aggregated", "--decode", "2", "--decode-cpus", f"{first},{second}"],
    }


def measure(name: str, up_args: list[str], args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """Start the layout, run ``tandem bench`` against it, stop it; returns the bench result."""
    log_dir = out_dir / name
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"== {name}: tandem up {' '.join(up_args)}", flush=True)
    up = TandemUp(log_dir, "--quiet", *up_args).start()
    result_path = log_dir / "bench.json"
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "--base-url", up.url, "--dataset", "mixed",
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--long-share", str(args.long_share), "--long-tokens", str(args.long_tokens),
           "--long-output-len", str(args.long_output_len), "--rate", args.rates, "--duration", str(args.duration),
           "--warmup", "2", "--goodput", f"ttft:{args.slo_ttft}", f"itl:{args.slo_itl}",
           "--json", str(result_path), "--plot", str(log_dir / "bench.png"), "--no-progress"]
    children = up.info["children"]  # the ready file goes when it stops
    try:
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        decisions = prefill_decisions(children)
    finally:
        up.stop()
    result = json.loads(result_path.read_text())
    result["layout"] = {"name": name, "up_args": up_args, "placement": [c.get("placement", "") for c in children],
                        "prefill_decisions": decisions}
    return result


def prefill_decisions(children: list[dict[str, Any]]) -> dict[str, float]:
    """Where the decode workers prefilled prompts, and why: ``mode/reason`` -> count, over all of them."""
    from bench.report import metric_samples

    counts: dict[str, float] = {}
    for c in children:
        if c["role"] == "gateway" or not c.get("metrics_port"):
            continue
        for s in metric_samples(f"http://127.0.0.1:{c['metrics_port']}/metrics"):
            if s.name == "tandem_decode_prefill_decisions_total" and s.value:
                key = f"{s.labels['mode']}/{s.labels['reason']}"
                counts[key] = counts.get(key, 0) + s.value
    return counts


def rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per layout and rate: the figures the issue asks for."""
    out = []
    for name, res in results.items():
        for run in res["runs"]:
            short, long = run["by_kind"].get("short", {}), run["by_kind"].get("long", {})
            out.append({
                "layout": name, "rate": run["load"]["rate"],
                "short_itl_p99": short.get("latency_ms", {}).get("itl", {}).get("p99"),
                "short_ttft_p90": short.get("latency_ms", {}).get("ttft", {}).get("p90"),
                "long_ttft_p50": long.get("latency_ms", {}).get("ttft", {}).get("p50"),
                "long_ttft_p90": long.get("latency_ms", {}).get("ttft", {}).get("p90"),
                "short_tok_s": short.get("throughput", {}).get("output_tokens_per_s"),
                "goodput": run["goodput"]["requests_per_s"], "goodput_short": short.get("goodput", {})
                .get("requests_per_s"), "failed": run["requests"]["failed"],
                "prefill_decisions": res["layout"].get("prefill_decisions", {}),
            })
    return out


def verdict(table: list[dict[str, Any]], slo_itl: float) -> str:
    """The issue's two targets, checked at the first rate where aggregated-512 misses the ITL SLO."""
    agg = {r["rate"]: r for r in table if r["layout"] == "aggregated-512"}
    dis = {r["rate"]: r for r in table if r["layout"] == "disaggregated"}
    if not agg or not dis:
        return "The targets compare disaggregated with aggregated-512; this run measured only one of them."
    over = [rate for rate in sorted(agg) if (agg[rate]["short_itl_p99"] or 0) > slo_itl and rate in dis]
    if not over:
        return f"aggregated-512's short ITL p99 stayed within {slo_itl:g} ms at every rate: no crossing to compare at."
    rate = over[0]
    a, d = agg[rate], dis[rate]
    itl_ratio = d["short_itl_p99"] / a["short_itl_p99"] if d["short_itl_p99"] else float("nan")
    if not d["goodput"]:
        good = f"goodput {d['goodput']:.3f} against {a['goodput']:.3f} req/s (target ≥ 2×: missed)"
    else:
        good_ratio = d["goodput"] / a["goodput"] if a["goodput"] else float("inf")
        good = (f"goodput {d['goodput']:.3f} against {a['goodput']:.3f} req/s, {good_ratio:.2f}× "
                f"(target ≥ 2×: {'met' if good_ratio >= 2 else 'missed'})")
    return (f"At {rate:g} req/s (aggregated-512's short ITL p99 {a['short_itl_p99']:.0f} ms > {slo_itl:g} ms): "
            f"disaggregated's is {d['short_itl_p99']:.0f} ms, {itl_ratio:.2f}× (target ≤ 0.25×: "
            f"{'met' if itl_ratio <= 0.25 else 'missed'}); {good}. " + borrowing_verdict(a, d))


def borrowing_verdict(a: dict[str, Any], d: dict[str, Any]) -> str:
    """Issue 24's targets for a split that lends the decode core to prefill, against aggregated at one rate."""
    def ratio(key: str) -> float:
        return d[key] / a[key] if d.get(key) and a.get(key) else float("nan")

    short, long = ratio("short_tok_s"), ratio("long_ttft_p50")
    return (f"Short chats' output {short:.2f}× aggregated-512's (target ≥ 0.8×: "
            f"{'met' if short >= 0.8 else 'missed'}) and long prompts' TTFT p50 {long:.2f}× (target ≤ 1.2×: "
            f"{'met' if long <= 1.2 else 'missed'}).")


def markdown(table: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f} ms"

    sweep = f" --local-prefill-max-tokens {args.local_prefill_max_tokens}" if args.local_prefill_max_tokens else ""
    title = ("## Experiment 3: the floor of conditional disaggregation (bench/pd_vs_aggregated.py)" if sweep else
             "## Experiment 1: P/D against aggregated on the same two cores (bench/pd_vs_aggregated.py)")
    lines = [
        title, "",
        f"`python -m bench.pd_vs_aggregated --rates {args.rates} --duration {args.duration:g}{sweep}`: `mixed` load — short "
        f"chats of {args.input_len} prompt tokens and {args.output_len} out, plus {args.long_tokens}-token prompts "
        f"({args.long_output_len} out) as {args.long_share:g} of the requests — Poisson arrivals, "
        f"{args.duration:g} s per rate after 2 warm-up requests; goodput at TTFT ≤ {args.slo_ttft / 1000:g} s and "
        f"ITL ≤ {args.slo_itl:g} ms. The load generator, NATS and the gateway run on the same two cores.", "",
        "| layout | rate (req/s) | short ITL p99 | short TTFT p90 | short out (tok/s) | long TTFT p50 | long TTFT p90 "
        "| goodput (req/s) | goodput, short | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        tok_s = "-" if r.get("short_tok_s") is None else f"{r['short_tok_s']:.1f}"
        lines.append(f"| {r['layout']} | {r['rate']:g} | {ms(r['short_itl_p99'])} | {ms(r['short_ttft_p90'])} | "
                     f"{tok_s} | {ms(r.get('long_ttft_p50'))} | {ms(r['long_ttft_p90'])} | {r['goodput']:.3f} | "
                     f"{r['goodput_short'] or 0:.3f} | {r['failed']} |")
    decided: dict[str, dict[str, float]] = {}
    for r in table:
        if r.get("prefill_decisions"):
            decided.setdefault(r["layout"], r["prefill_decisions"])
    if decided:
        lines += ["", "Where the decode workers prefilled the prompts (all rates; `tandem_decode_prefill_decisions_total`):"]
        lines += [f"- {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))
                  for name, d in decided.items()]
    lines += ["", verdict(table, args.slo_itl)]
    return "\n".join(lines) + "\n"


def plot(table: list[dict[str, Any]], prefix: str = "pd", slo_itl: float | None = None) -> str:
    from bench.report import plot_lines

    names = sorted({r["layout"] for r in table})
    itl = {n: [(r["rate"], r["short_itl_p99"]) for r in table if r["layout"] == n and r["short_itl_p99"]]
           for n in names}
    good = {n: [(r["rate"], r["goodput"]) for r in table if r["layout"] == n] for n in names}
    return (plot_lines(f"{prefix}_itl_p99", "short requests' ITL p99 under mixed load", "offered rate (req/s)", "ms",
                       itl, logy=True, hline=(slo_itl, f"SLO {slo_itl:g} ms") if slo_itl else None)
            + plot_lines(f"{prefix}_goodput", "goodput at the SLOs", "offered rate (req/s)", "req/s", good))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.pd_vs_aggregated", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0.25,0.5,1", help="offered rates, requests/s (default 0.25,0.5,1)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate (default 60)")
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--long-share", type=float, default=0.1)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--long-output-len", type=int, default=16)
    p.add_argument("--slo-ttft", type=float, default=3000.0, help="ms (default 3000)")
    p.add_argument("--slo-itl", type=float, default=150.0, help="ms (default 150)")
    p.add_argument("--layouts", default=None, help="comma-separated subset (default all, or with "
                   "--local-prefill-max-tokens only its sweep)")
    p.add_argument("--local-prefill-max-tokens", default=None,
                   help="sweep this floor, comma-separated (default: no sweep)")
    p.add_argument("--stall-budget-ms", type=float, default=None,
                   help="--prefill-stall-budget-ms of the sweep's workers (default: the workers' default)")
    p.add_argument("--out", default=None, help="folder for logs and raw results (default a temp folder)")
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md and its plots")
    p.add_argument("--render", default=None, metavar="DIR",
                   help="measure nothing: show (and with --write, write) DIR/results.json of an earlier run, "
                        "given the same flags")
    args = p.parse_args(argv)
    if args.render:
        return report(json.loads((Path(args.render) / "results.json").read_text()), args)
    if len(available_cpus()) < 2:
        print("bench.pd_vs_aggregated needs two cores", file=sys.stderr)
        return 2
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="tandem-pd-"))
    floors = [int(x) for x in args.local_prefill_max_tokens.split(",")] if args.local_prefill_max_tokens else []
    all_layouts = layouts(floors, args.stall_budget_ms)
    sweep = [f"disaggregated-lp{n}" for n in floors]
    if args.layouts is None:
        chosen = sweep or [n for n in all_layouts if not n.startswith("disaggregated-lp")]
    else:
        chosen = sweep + [n.strip() for n in args.layouts.split(",") if n.strip() not in sweep]
    unknown = [n for n in chosen if n not in all_layouts]
    if unknown:
        print(f"unknown layout {', '.join(unknown)}; choose from {', '.join(all_layouts)}", file=sys.stderr)
        return 2
    results = {name: measure(name, all_layouts[name], args, out_dir) for name in chosen}
    (out_dir / "results.json").write_text(json.dumps(rows(results), indent=1))
    print(f"raw results and per-layout plots: {out_dir}")
    return report(rows(results), args)


def report(table: list[dict[str, Any]], args: argparse.Namespace) -> int:
    """Print the table; with ``--write``, put it and its plots into docs/benchmarks.md (experiment 3, the
    sweep, in a section of its own)."""
    text = markdown(table, args)
    print(text)
    if args.write:
        from bench.report import write_section

        sweep = bool(args.local_prefill_max_tokens)
        write_section("pd-sweep" if sweep else "pd-vs-aggregated", text + "\n" + plot(table, "pd_sweep" if sweep else "pd", args.slo_itl))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
