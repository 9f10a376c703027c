"""A start-up that talks and errors that say where: a worker's start-up phases, its /health and /ready on the
metrics port (before and after it can serve), GGUF files cut short or not GGUF at all, `tandem up` checking
the model once, and the embedded NATS's monitoring port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.cluster import Worker, tandem_cmd
from bus.server import EmbeddedNats
from engine.model_files import load_text, resolve_model_path
from engine.model_text import ModelLoadError
from runtime.health import WorkerHealth
from tests.harness.reference_models import finish_gguf
from tests.harness.wait import wait_until

pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def truncated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's GGUF cut in half (its header and tensor table intact)."""
    src = resolve_model_path("smollm2-135m-instruct")
    dst = tmp_path_factory.mktemp("gguf") / "cut.gguf"
    with open(src, "rb") as f, open(dst, "wb") as out:
        out.write(f.read(src.stat().st_size // 2))
    return dst


def test_a_truncated_gguf_names_the_file_tensor_and_sizes(truncated: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError) as e:
        load_text(str(truncated))
    msg = str(e.value)
    assert msg.startswith(f"{truncated}: truncated: tensor ") and " needs " in msg and " at offset " in msg
    assert f"the file has {truncated.stat().st_size:,} bytes" in msg


def test_a_file_that_is_not_gguf_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"this is not a model\n" * 10)
    with pytest.raises(ModelLoadError, match=rf"^{bad}: not a readable GGUF file: GGUF magic invalid"):
        load_text(str(bad))
    short = tmp_path / "short.gguf"
    shutil.copyfile(resolve_model_path("smollm2-135m-instruct"), short)
    with open(short, "r+b") as f:
        f.truncate(100)  # inside the header
    with pytest.raises(ModelLoadError, match=rf"^{short}: not a readable GGUF file"):
        load_text(str(short))
    with open(short, "wb") as f, open(resolve_model_path("smollm2-135m-instruct"), "rb") as src:
        f.write(src.read(300_000))  # inside the vocabulary: engine.gguf_file hands it to gguf's reader
    with pytest.raises(ModelLoadError, match=rf"^{short}: not a readable GGUF file"):
        load_text(str(short))


def _tensor_table(reader) -> tuple[list, int]:
    return [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in reader.tensors], reader.data_offset


def _stock_reading(path: Path) -> tuple[dict, list, int]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return ({k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}, *_tensor_table(reader))


def _our_reading(path: Path) -> tuple[dict, list, int]:
    from engine.gguf_file import gguf_fields, open_gguf

    reader = open_gguf(path)
    return (gguf_fields(reader), *_tensor_table(reader))


def test_gguf_metadata_reads_as_ggufs_own_reader(tmp_path: Path) -> None:
    """engine.gguf_file reads a GGUF's metadata itself (gguf's reader took 2.3 s over the default model's vocabulary,
    10 s over Gemma 3's): every value type, arrays of each, a custom alignment and the real default model read as
    gguf's reader reads them, value for value and type for type; an array of arrays, which it leaves to that
    reader, too."""
    import gguf
    import numpy as np

    from engine.gguf_file import gguf_fields

    T = gguf.GGUFValueType
    scalars = {T.UINT8: 200, T.INT8: -100, T.UINT16: 60_000, T.INT16: -30_000, T.UINT32: 4_000_000_000,
               T.INT32: -2_000_000_000, T.FLOAT32: 0.1, T.BOOL: True, T.UINT64: 2**63 + 5, T.INT64: -(2**62),
               T.FLOAT64: 0.1}
    for name, nested in (("every-type.gguf", False), ("nested.gguf", True)):
        path = tmp_path / name
        w = gguf.GGUFWriter(path, "llama")
        w.add_custom_alignment(64)
        for kind, value in scalars.items():
            w.add_key_value(f"test.{kind.name.lower()}", value, kind)
            w.add_key_value(f"test.{kind.name.lower()}s", [value, value, value], T.ARRAY, kind)
        w.add_key_value("test.text", "Grüße, 世界 🙂", T.STRING)
        w.add_key_value("test.texts", ["", "a", "Grüße", "世界 🙂"] * 3, T.ARRAY, T.STRING)
        if nested:
            w.add_key_value("test.nested", [[1, 2], [3, 4]], T.ARRAY, T.ARRAY)
        w.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
        w.add_tensor("b", np.ones(5, dtype=np.float16))
        finish_gguf(w)
        ours, stock = _our_reading(path), _stock_reading(path)
        assert ours == stock
        assert gguf_fields(gguf.GGUFReader(str(path))) == ours[0]  # a reader that never called _build_fields
        assert [type(v) for v in ours[0].values()] == [type(v) for v in stock[0].values()]
        assert ours[0]["test.texts"][3] == "世界 🙂" and ours[0]["test.uint64"] == 2**63 + 5
    odd = tmp_path / "odd-alignment.gguf"
    w = gguf.GGUFWriter(odd, "llama")
    w.add_key_value("general.alignment", 64, T.UINT64)  # gguf's reader refuses it; so must we
    w.add_tensor("a", np.ones(3, dtype=np.float32))
    finish_gguf(w)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file: Bad type for general.alignment"):
        _our_reading(odd)
    ours, stock = _our_reading(resolve_model_path("smollm2-135m-instruct")), \
        _stock_reading(resolve_model_path("smollm2-135m-instruct"))
    assert ours == stock and len(ours[0]["tokenizer.ggml.tokens"]) == 49152


def test_tandem_up_checks_the_model_once_before_starting_anything(truncated: Path, tmp_path: Path) -> None:
    r = subprocess.run(tandem_cmd("up", "--model", str(truncated), "--port", "0", "--nats-port", "0",
                                  "--metrics-port-base", "0"), capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TANDEM_CACHE_DIR": str(tmp_path)})
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert out.count("truncated: tensor") == 1 and str(truncated) in out
    assert "connecting to NATS" not in out and "nats-server" not in out  # nothing was started


def test_readiness_says_what_is_missing() -> None:
    h = WorkerHealth("decode_only", "d1")
    assert h.readiness() == (False, {"status": "not_ready", "phase": "starting", "role": "decode_only",
                                     "worker_id": "d1", "model_loaded": False, "nats_connected": False,
                                     "reason": "the model is loading"})
    h.model_loaded, h.phase, h.nats_connected = True, "ready", lambda: True
    assert h.readiness()[0]
    h.nats_connected = lambda: False
    assert h.readiness()[1]["reason"] == "not connected to NATS"
    h.nats_connected, h.phase = (lambda: True), "draining"
    assert h.readiness() == (False, {**h.readiness()[1], "reason": "draining"})


def test_worker_health_and_ready_on_its_metrics_port(tmp_path: Path) -> None:
    """/health answers while the worker cannot serve yet (here: NATS is not up), /ready says why not; once
    NATS is there, /ready turns 200; the start-up phases are lines of its output."""
    nats_port, metrics_port = free_port(), free_port()
    worker = Worker("prefill_and_decode", "probe-1", f"nats://127.0.0.1:{nats_port}", tmp_path,
                    "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1")
    base = f"http://127.0.0.1:{metrics_port}"
    try:
        wait_until(lambda: _get(f"{base}/health"), 120, "/health")
        not_ready = wait_until(lambda: (r := _get(f"{base}/ready")) is not None and r.json()["phase"] == "connecting"
                               and r, 120, "the connecting phase")
        assert not_ready.status_code == 503 and not_ready.json()["model_loaded"] is True
        assert not_ready.json()["reason"] == "not connected to NATS"
        with EmbeddedNats(port=nats_port):
            worker.wait_ready(120)
            ready = wait_until(lambda: (r := _get(f"{base}/ready")) is not None and r.status_code == 200 and r,
                               60, "/ready 200")
            assert ready.json()["status"] == "ready" and ready.json()["nats_connected"] is True
            assert "# HELP" in httpx.get(f"{base}/metrics", timeout=5).text
            out = worker.tail(200)
            for phase in ("probe-1: reading ", "probe-1: model loaded", "probe-1: connecting to NATS at"):
                assert phase in out, out
            worker.stop(60)
    finally:
        worker.kill()


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None


def test_embedded_nats_monitoring_port(tmp_path: Path) -> None:
    port = free_port()
    with EmbeddedNats(monitor_port=port) as srv:
        assert srv.monitor_url == f"http://127.0.0.1:{port}"
        jsz = httpx.get(f"{srv.monitor_url}/jsz", timeout=5).json()
        assert "streams" in jsz or "config" in jsz
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "nats", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert "--nats-monitor-port" in r.stdout
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "up", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert "--nats-monitor-port" in r.stdout
