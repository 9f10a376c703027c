"""The page at `/`: chat and the cluster view, driven in a real browser (Debian's Chromium through Playwright)
against a real `tandem up` with API keys on.

Playwright's own browser download cannot be used here, so the tests launch the system's Chromium
(`apt-get install chromium`; `.ci/run` does) and skip, saying so, where it or Playwright is missing.
With ``TANDEM_SCREENSHOTS=<folder>`` they also save the screenshots shown in docs/ and the README.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.cluster import MODEL, TandemUp
from tests.harness.wait import wait_until

CHROMIUM = os.environ.get("TANDEM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import Browser, Page, expect, sync_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    sync_playwright = None

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(sync_playwright is None, reason="needs Playwright (pip install playwright)"),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium), launched by Playwright"),
]

KEY = "page-test-key"
WEB = Path(__file__).resolve().parents[1] / "gateway" / "web"
#: flags for a headless Chromium on a machine whose only network is loopback
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemUp]:
    # a killed worker comes back after 8 s, not 1: long enough past the gateway's 3 s of silence for the page to
    # show it dead (with the default 1 s and a warm start it could be back before the page's next look)
    cluster = TandemUp(tmp_path_factory.mktemp("page"), "--stop-timeout", "10", "--restart-delay", "8",
                       "--worker-args", "--num-blocks 512 --local-prefill-max-tokens 16",
                       env={"TANDEM_API_KEYS": KEY})
    cluster.start(300)
    try:
        yield cluster
    finally:
        cluster.stop(90)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def open_page(browser: Browser, up: TandemUp, width: int = 1200, height: int = 800) -> tuple[Page, Any, list[str]]:
    """A fresh browser context on the page, logged in with the key; every URL it requests is recorded."""
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    page.goto(up.url)
    dialog = page.locator("#key-dialog")
    expect(dialog).to_be_visible(timeout=10_000)  # the API asked for a key
    page.fill("#api-key", KEY)
    page.click("#key-form button")
    expect(page.locator("#model-name")).to_have_text(MODEL, timeout=10_000)
    return page, context, requested


def close_page(context: Any, requested: list[str], up: TandemUp) -> None:
    context.close()
    strangers = [u for u in requested if not (u.startswith(up.url + "/") or u == up.url or u.startswith("data:"))]
    assert requested and not strangers, f"requests left the page's origin: {strangers}"


def screenshot(page: Page, name: str) -> None:
    folder = os.environ.get("TANDEM_SCREENSHOTS")
    if folder:
        page.screenshot(path=str(Path(folder) / name))


def settings(page: Page, **fields: str) -> None:
    """Open the settings panel and fill fields by element id (``max_tokens`` is ``#max-tokens``)."""
    if page.locator("#settings").get_attribute("open") is None:
        page.click("#settings summary")
    for name, value in fields.items():
        page.fill(f"#{name.replace('_', '-')}", value)


def ask(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def worker_metrics(up: TandemUp, name: str) -> str:
    port = up.child_info(name)["metrics_port"]
    return f"http://127.0.0.1:{port}/metrics"


def test_a_question_streams_an_answer_token_by_token(browser: Browser, up: TandemUp) -> None:
    page, context, requested = open_page(browser, up)
    settings(page, temperature="0", max_tokens="64")
    ask(page, "Write a short poem about the sea.")
    answer = page.locator(".msg.assistant .body").last
    lengths: list[int] = []

    def finished() -> bool:  # its length sampled as it grows
        lengths.append(len(answer.inner_text()))
        return not page.locator("#stop").is_visible()

    wait_until(finished, 120, "the answer to finish", interval=0.03)
    grew = sorted(set(lengths))
    assert len(grew) >= 4 and grew[0] < grew[-1], f"the answer did not grow token by token: {grew}"
    meta = page.locator(".msg.assistant .meta").last.inner_text()
    assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s · \d+ tokens · prefill (local|remote)", meta), meta
    assert "decode on decode-1" in meta
    # the conversation is kept in the browser: a reload shows it again
    page.reload()
    expect(page.locator(".msg.user").first).to_have_text("Write a short poem about the sea.")
    screenshot(page, "page_chat.png")
    close_page(context, requested, up)


def test_stop_cancels_the_request_on_the_worker(browser: Browser, up: TandemUp) -> None:
    page, context, requested = open_page(browser, up)
    url = worker_metrics(up, "decode-1")
    before = metric(url, "tandem_worker_cancelled_total")
    settings(page, max_tokens="2000", temperature="0.8")
    ask(page, "Tell me a very long story about a lighthouse keeper.")
    answer = page.locator(".msg.assistant .body").last
    expect(answer).not_to_be_empty(timeout=60_000)
    page.click("#stop")
    expect(page.locator(".msg.assistant .meta").last).to_contain_text("stopped", timeout=10_000)
    wait_until(lambda: metric(url, "tandem_worker_cancelled_total") > before
               and metric(url, "tandem_worker_running_sequences") == 0,
               15, "the worker to stop generating after Stop", interval=0.2)
    assert page.locator("#send").is_visible() and page.locator("#prompt").is_enabled()
    close_page(context, requested, up)


def test_html_from_the_user_or_the_model_shows_as_text_and_runs_nothing(browser: Browser, up: TandemUp) -> None:
    page, context, requested = open_page(browser, up)
    attack = '<img src=x onerror="window.__pwned = 1"><script>window.__pwned = 2</script>'
    settings(page, max_tokens="8")
    ask(page, attack)
    expect(page.locator(".msg.user").last).to_have_text(attack)
    expect(page.locator("#stop")).to_be_hidden(timeout=60_000)
    assert page.locator("#messages img, #messages script").count() == 0
    # the model's text goes through the page's Markdown renderer: the same strings, and a javascript: link
    html = page.evaluate("""() => {
        const html = renderMarkdown('**bold** `x<y` <img src=x onerror="window.__pwned = 3">\\n\\n' +
            '<script>window.__pwned = 4</script>\\n\\n[link](javascript:window.__pwned=5)');
        const box = document.createElement('div');
        box.innerHTML = html;
        document.body.append(box);
        box.querySelectorAll('a').forEach((a) => a.click());
        return html;
    }""")
    assert "<strong>bold</strong>" in html and "&lt;img" in html and "&lt;script" in html
    assert "<img" not in html and "<script" not in html and "javascript:" not in html
    page.wait_for_timeout(300)
    assert page.evaluate("() => window.__pwned") is None
    close_page(context, requested, up)


def test_the_cluster_view_shows_the_split_and_counts_transfers(browser: Browser, up: TandemUp) -> None:
    page, context, requested = open_page(browser, up)
    page.get_by_role("tab", name="Cluster").click()
    rows = page.locator("#workers tbody tr")
    expect(page.locator('#workers tr[data-worker="prefill-1"]')).to_contain_text("prefill_only", timeout=10_000)
    expect(page.locator('#workers tr[data-worker="decode-1"]')).to_contain_text("decode_only")
    assert rows.count() == 2
    expect(page.locator('#workers tr[data-worker="decode-1"]')).to_have_class("alive")
    expect(page.locator("#pools tbody tr")).to_have_count(2)
    count = page.locator("#transfer-count")
    expect(count).to_have_attribute("data-total", re.compile(r"\d+"))
    before = int(count.get_attribute("data-total") or 0)
    long_prompt = " ".join(f"Line {i}: the tide comes in and the tide goes out." for i in range(60))
    r = httpx.post(f"{up.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": long_prompt}]})
    assert r.status_code == 200 and r.headers["x-tandem-prefill"].startswith("remote"), r.headers
    expect(count).not_to_have_attribute("data-total", str(before), timeout=10_000)
    assert int(count.get_attribute("data-total") or 0) == before + 1
    first = page.locator("#transfers tbody tr").first
    expect(first).to_contain_text("prefill-1 → decode-1")
    expect(page.locator("#decisions tbody tr").first).to_contain_text("remote")
    screenshot(page, "page_cluster.png")
    close_page(context, requested, up)


def test_a_worker_that_dies_turns_dead_and_comes_back(browser: Browser, up: TandemUp) -> None:
    page, context, requested = open_page(browser, up)
    page.get_by_role("tab", name="Cluster").click()
    row = page.locator('#workers tr[data-worker="prefill-1"]')
    expect(row).to_have_class("alive", timeout=10_000)
    victim = up.child_info("prefill-1")["pid"]
    os.kill(victim, signal.SIGKILL)
    expect(row).to_have_class("dead", timeout=10_000)
    expect(row).to_contain_text("dead")
    expect(row).to_have_class("alive", timeout=120_000)  # `tandem up` restarts it
    assert up.child_info("prefill-1")["pid"] != victim
    close_page(context, requested, up)


def test_a_phone_sized_window_can_chat(browser: Browser, up: TandemUp) -> None:
    page, context, requested = open_page(browser, up, width=375, height=740)
    for sel in ("#prompt", "#send", "#tab-cluster"):
        box = page.locator(sel).bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 375, (sel, box)
    settings(page, max_tokens="16")
    ask(page, "Hi!")
    expect(page.locator(".msg.assistant .meta").last).to_contain_text("TTFT", timeout=60_000)
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 375
    close_page(context, requested, up)


def test_the_page_is_small_self_contained_and_guarded(up: TandemUp) -> None:
    r = httpx.get(up.url, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["referrer-policy"] == "no-referrer"
    assert "<script>" not in r.text and not re.search(r"\son[a-z]+\s*=", r.text)  # no inline script of any kind
    weight = sum(len(httpx.get(f"{up.url}{src}", timeout=10).content) for src in re.findall(
        r'(?:src|href)="(/static/[^"]+)"', r.text)) + len(r.content)
    assert weight < 150_000, weight
    assert sum(p.stat().st_size for p in WEB.rglob("*") if p.suffix in (".html", ".css", ".js")) < 150_000
    # the cluster endpoint is behind the key, and shows no credential or file path
    assert httpx.get(f"{up.url}/cluster", timeout=10).status_code == 401
    c = httpx.get(f"{up.url}/cluster", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert c.status_code == 200
    body = c.text
    assert {w["worker_id"] for w in c.json()["workers"]} == {"prefill-1", "decode-1"}
    assert ".nk" not in body and "/.cache" not in body and "password" not in body and KEY not in body
    assert httpx.get(f"{up.url}/static/../bus/credentials.py", timeout=10).status_code == 404
