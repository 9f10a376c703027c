"""Where tandem keeps what it derives from model files (``TANDEM_CACHE_DIR``), and the file digests that key it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CACHE_FORMAT = 5  # of the weight cache: 3 = Q8_0 kept, 4 = int4 in GGUF's (d, m) per group, 5 = Q4_K/Q5_0/Q6_K kept


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def stat_digest(path: Path) -> str:
    """The file's SHA-256, remembered per (path, size, mtime) so a warm start need not rehash it."""
    st = path.stat()
    index = cache_dir() / "weights" / "digests.json"
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    known = json.loads(index.read_text()) if index.exists() else {}
    if key not in known:
        known[key] = file_digest(path)
        write_atomic(index, json.dumps(known, indent=1).encode())
    return known[key]


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a concurrent reader sees the old state or the whole file


def cache_file(digest: str, kind: str, suffix: str, version: int = CACHE_FORMAT) -> Path:
    """<cache>/weights/<digest>-<kind>-v<format><suffix>: everything derived from one model file."""
    return cache_dir() / "weights" / f"{digest[:24]}-{kind}-v{version}{suffix}"
