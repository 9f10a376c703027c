"""Write a benchmark's markdown section into docs/benchmarks.md between its own markers."""

from __future__ import annotations

from pathlib import Path

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
