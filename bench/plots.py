"""``tandem bench --plot``: one PNG of a result — latency CDFs, ITL over time, goodput against rate.

Why these three: a CDF shows the whole latency distribution of each load level (tails
included); ITL over time with the long prompts' arrivals marked shows whether a long prefill
stalls the short requests' decoding (the case for disaggregation); goodput against offered
rate shows where a layout stops meeting its SLOs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.loadgen import chunk_gaps


def _gaps(rec: dict[str, Any]) -> list[tuple[float, float]]:
    """(arrival in the level's seconds, gap in ms) of each inter-token gap of a request record."""
    return [(rec["start_s"] + t, g * 1000.0) for t, g in chunk_gaps(rec["chunks"])]


def _label(run: dict[str, Any]) -> str:
    load = run["load"]
    if load["mode"] == "rate":
        return f"rate {load['rate']:g}/s" if load["rate"] is not None else "rate inf"
    return f"concurrency {load['concurrency']}"


def _cdf(ax: Any, values: list[float], label: str, style: str) -> None:
    if not values:
        return
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step([xs[0], *xs], [0.0, *ys], where="post", label=label, linestyle=style)


def write_plot(result: dict[str, Any], path: Path) -> None:
    """Draw ``result`` (the ``--json`` document) into ``path`` (PNG); ValueError without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'tandem[bench]'") from None
    runs = result["runs"]
    sweep = [r for r in runs if r["load"]["mode"] == "rate" and r["load"]["rate"] is not None]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), dpi=100)
    (ax_ttft, ax_itl), (ax_time, ax_good) = axes
    styles = {"": "-", "short": "-", "long": "--"}
    for run in runs:
        kinds = sorted({r["kind"] for r in run["records"]})
        for kind in kinds:
            recs = [r for r in run["records"] if r["kind"] == kind and r["error_kind"] is None]
            name = _label(run) + (f" {kind}" if kind else "")
            _cdf(ax_ttft, [r["ttft_s"] * 1000.0 for r in recs if r["ttft_s"] is not None], name, styles.get(kind, ":"))
            _cdf(ax_itl, [g for r in recs for _, g in _gaps(r)], name, styles.get(kind, ":"))
    for ax, what in ((ax_ttft, "TTFT"), (ax_itl, "inter-token latency")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{what} (ms)")
        ax.set_ylabel("share of requests" if what == "TTFT" else "share of gaps")
        ax.set_title(f"{what}, CDF")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    # ITL over time: the busiest level (last of a sweep)
    run = runs[-1]
    short = [r for r in run["records"] if r["kind"] != "long" and r["error_kind"] is None]
    points = [p for r in short for p in _gaps(r)]
    if points:
        ax_time.scatter([t for t, _ in points], [g for _, g in points], s=4, alpha=0.5,
                        label="gaps of short requests" if any(r["kind"] for r in short) else "gaps")
    longs = [r["start_s"] for r in run["records"] if r["kind"] == "long"]
    for i, t in enumerate(longs):
        ax_time.axvline(t, color="red", linestyle="--", linewidth=0.8, label="long prompt sent" if i == 0 else None)
    ax_time.set_yscale("log")
    ax_time.set_xlabel("time since the level started (s)")
    ax_time.set_ylabel("inter-token gap (ms)")
    ax_time.set_title(f"ITL over time, {_label(run)}")
    ax_time.grid(True, alpha=0.3)
    if points or longs:
        ax_time.legend(fontsize=7)
    if len(sweep) >= 2 and sweep[0]["goodput"] is not None:
        rates = [r["load"]["rate"] for r in sweep]
        ax_good.plot(rates, rates, color="grey", linestyle=":", label="offered")
        ax_good.plot(rates, [r["goodput"]["requests_per_s"] for r in sweep], marker="o", label="all")
        for kind in sorted({k for r in sweep for k in r["by_kind"]}):
            ax_good.plot(rates, [r["by_kind"].get(kind, {}).get("goodput", {}).get("requests_per_s") for r in sweep],
                         marker="o", linestyle=styles.get(kind, ":"), label=kind)
        slo = ", ".join(f"{k} ≤ {v:g} ms" for k, v in result["config"]["slo_ms"].items())
        ax_good.set_title(f"goodput ({slo})")
        ax_good.set_xlabel("offered rate (requests/s)")
        ax_good.set_ylabel("goodput (requests/s)")
        ax_good.grid(True, alpha=0.3)
        ax_good.legend(fontsize=7)
    else:
        _cdf(ax_good, [r["e2e_s"] * 1000.0 for run in runs for r in run["records"] if r["e2e_s"] is not None
                       and r["error_kind"] is None], "all levels", "-")
        ax_good.set_xscale("log")
        ax_good.set_title("end-to-end latency, CDF (goodput against rate needs a --rate sweep and --goodput)")
        ax_good.title.set_fontsize(8)
        ax_good.set_xlabel("E2E (ms)")
        ax_good.grid(True, alpha=0.3)
    server = result["server"]
    fig.suptitle(f"tandem bench: {server['kind']} at {server['base_url']}, model {result['config']['model']}, "
                 f"dataset {result['config']['dataset']['name']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
