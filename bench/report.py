"""Write a benchmark's markdown section into docs/benchmarks.md between its own markers; plot; read
a process's Prometheus metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

BENCH_DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def write_section(name: str, markdown: str, path: Path = BENCH_DOC) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{markdown.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail.lstrip("\n")
    else:
        text = text.rstrip() + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def metric_samples(url: str, timeout: float = 10.0) -> Iterator[Any]:
    """Every sample (``name``, ``labels``, ``value``) the /metrics endpoint at ``url`` serves now."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url, timeout=timeout).text):
        yield from family.samples


def plot_lines(name: str, title: str, xlabel: str, ylabel: str, series: dict[str, list[tuple[float, float]]],
               logx: bool = True, logy: bool = False, hline: tuple[float, str] | None = None) -> str:
    """Save a line plot as docs/<name>.png; returns the markdown that shows it ('' without matplotlib).
    ``hline``: (y, label) of a dashed horizontal line, e.g. an SLO."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(plot skipped: matplotlib is not installed; `pip install matplotlib` and rerun)\n"
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
    for label, points in series.items():
        if not points:
            continue
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=label)
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    if logx:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))  # 0.25, not 2^-2
    if logy:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(2, 3, 5)))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    if hline is not None:
        ax.axhline(hline[0], color="gray", linestyle="--", linewidth=1, label=hline[1])
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = BENCH_DOC.parent / f"{name}.png"
    fig.savefig(out)
    plt.close(fig)
    return f"![{title}]({out.name})\n"
