"""The live dashboard (/dashboard): its routes, API key and flag over HTTP, its event stream, and the page itself in
headless Chromium (Debian's chromium and chromium-driver, driven by Selenium): the timeline shows the requests' rows,
the pool chart moves, hovering a cell names its request, and nothing is logged on the console. The screenshot goes to
test-artifacts/ (or $JUSTAPI_TEST_ARTIFACTS)."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
from pathlib import Path

import httpx
import pytest

from server_helpers import InProcessServer, dashboard_events, wait_until

ARTIFACTS = Path(os.environ.get("JUSTAPI_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("dashboard") / "serve.log"
    # a pool small enough that 12 requests of ~150 tokens preempt one another: the page has preemptions to mark
    # (and the prefix cache's disk tier: its panel shows what it wrote)
    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "60", "--block-size", "16", "--chunk-size", "64",
                           "--spec-method", "ngram", "--dashboard-prompt-text", "--prefix-cache-dir",
                           str(log.parent / "kv")], str(log))
    yield srv
    srv.stop()


def _complete(url: str, i: int, headers=None) -> str:
    r = httpx.post(url + "/v1/completions", headers=headers, timeout=120, json={
        "prompt": "the quick brown fox jumps over the lazy dog " * (3 + i % 4) + f"request {i}",
        "max_tokens": 40 + 8 * (i % 16), "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["id"] + "-0"  # the engine's request id: the response id and the choice's index


def _other_families(url: str) -> None:
    """One request through Anthropic's Messages API and one through Ollama's."""
    anthropic = httpx.post(url + "/v1/messages", timeout=120, json={
        "model": "tiny-llama", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]})
    ollama = httpx.post(url + "/api/generate", timeout=120, json={
        "model": "tiny-llama", "prompt": "hello", "stream": False, "options": {"num_predict": 8}})
    assert anthropic.status_code == ollama.status_code == 200, (anthropic.text, ollama.text)


def test_event_stream_carries_each_request_s_steps_and_figures(server):
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        rids = list(pool.map(lambda i: _complete(server.url, i), range(6)))
    _other_families(server.url)
    messages = dashboard_events(server.url, 8)
    first = messages[0]  # a page that connects now gets the latest steps at once
    cells = [c for s in first["steps"] for c in s.get("cells", [])]
    assert {rid for rid, *_ in cells} >= set(rids)
    assert {kind for _, kind, *_ in cells} >= {"prefill", "decode"}
    assert all(sum(s["kv"]) == first["kv_blocks_total"] for s in first["steps"] if "kv" in s)
    assert {f["rid"] for f in first["finished"]} >= set(rids)
    assert first["window"]["requests"] >= 8 and first["window"]["ttft_ms"]["p50"] > 0
    by_api = first["window"]["by_api"]  # each API family's own requests and latencies
    assert by_api["openai"]["requests"] >= 6 and by_api["anthropic"]["requests"] == by_api["ollama"]["requests"] == 1
    assert by_api["anthropic"]["ttft_ms"]["p50"] > 0
    assert {f["api"] for f in first["finished"]} >= {"openai", "anthropic", "ollama"}
    assert first["output_tokens"] >= sum(40 + 8 * i for i in range(6))
    assert first["cache"]["hits"] > 0  # the prompts share their first words
    # the engine lists shared prefixes once a second while a page watches (--dashboard-prompt-text: with their text)
    assert "quick brown fox" in messages[-1]["cache"]["shared"][0]["text"]
    assert first["num_running"] == 0
    page = httpx.get(server.url + "/engine/steps", params={"since": 0, "limit": 5}).json()
    assert [r["seq"] for r in page["steps"]] == [0, 1, 2, 3, 4] and page["next"] == 5
    assert httpx.get(server.url + "/engine/steps", params={"limit": 0}).status_code == 400


def test_the_page_and_its_files_are_served_and_unknown_ones_are_404(server):
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert "EventSource" in httpx.get(server.url + "/dashboard/dashboard.js").text
    missing = httpx.get(server.url + "/dashboard/secrets.txt")
    assert missing.status_code == 404 and "secrets.txt" in missing.json()["error"]["message"]


def test_dashboard_sits_behind_the_api_key_and_is_off_with_a_flag(tiny_model, tmp_path):
    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "64", "--api-key", "k1,k2"], str(tmp_path / "a.log"))
    try:
        refused = httpx.get(srv.url + "/dashboard")
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
        assert httpx.get(srv.url + "/dashboard/events").status_code == 401
        wrong = "Basic " + base64.b64encode(b"admin:nope").decode()
        assert httpx.get(srv.url + "/dashboard", headers={"Authorization": wrong}).status_code == 401
        right = "Basic " + base64.b64encode(b"admin:k2").decode()
        assert httpx.get(srv.url + "/dashboard", headers={"Authorization": right}).status_code == 200
        for i in range(2):  # a shared prefix: its text stays off the page without --dashboard-prompt-text
            _complete(srv.url, i, headers={"Authorization": "Bearer k1"})
        feed = dashboard_events(srv.url, 8, headers={"Authorization": "Bearer k1"})[-1]
        assert feed["cache"]["shared"] and all(p["text"] is None for p in feed["cache"]["shared"])
        # HTTP Basic is taken on the dashboard only: the API's routes keep their bearer tokens
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": right}).status_code == 401
    finally:
        srv.stop()
    off = InProcessServer(["--model", tiny_model, "--pool-blocks", "64", "--no-dashboard"], str(tmp_path / "b.log"))
    try:
        assert httpx.get(off.url + "/dashboard").status_code == 404
        assert httpx.get(off.url + "/dashboard/events").status_code == 404
    finally:
        off.stop()


def _wait_for(driver, script: str, timeout_s: float = 60):
    return wait_until(lambda: driver.execute_script(script), timeout_s, f"the page's {script}")


def test_the_page_draws_the_schedule_live_in_chromium(server, browser):
    browser.get(server.url + "/dashboard")
    _wait_for(browser, "return window.justapiDashboard && window.justapiDashboard.messages > 0")
    start_seq = browser.execute_script("const c = window.justapiDashboard.columns; "
                                       "return c.length ? c[c.length - 1].seq : -1")
    pool_drawn = browser.execute_script("return document.getElementById('pool').toDataURL()")
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        rids = list(pool.map(lambda i: _complete(server.url, 100 + i), range(12)))
    # the timeline has a row for every request, and the requests table lists them
    seen = _wait_for(browser, f"const s = window.justapiDashboard.seen; "
                              f"return {json.dumps(rids)}.every(r => s.has(r)) && Array.from(s)")
    assert set(rids) <= set(seen)
    _wait_for(browser, f"const listed = Array.from(document.querySelectorAll('#requests tr[data-rid]'), "
                       f"r => r.dataset.rid); return {json.dumps(rids)}.every(r => listed.includes(r))")
    _other_families(server.url)  # the table by API family lists each family the window saw
    _wait_for(browser, "const apis = Array.from(document.querySelectorAll('#apis tr[data-api]'), r => r.dataset.api);"
                       " return ['openai', 'anthropic', 'ollama'].every(a => apis.includes(a))")
    # the pool chart moved: the blocks held by requests rose and fell over the steps these requests ran in
    held = browser.execute_script(f"return window.justapiDashboard.columns.filter(c => c.seq > {start_seq} && c.kv)"
                                  f".map(c => c.kv[0])")
    assert len(set(held)) > 3 and max(held) > min(held)
    assert browser.execute_script("return document.getElementById('pool').toDataURL()") != pool_drawn
    assert browser.execute_script("return window.justapiDashboard.columns.some(c => c.marks.some("
                                  "m => m.kind === 'preempted'))"), "12 requests over 60 blocks preempt"
    disk = _wait_for(browser, "const p = document.getElementById('disk-tier'), t = document.getElementById("
                              "'disk-figures').textContent; "
                              "return !p.hidden && /written [0-9.]+ MiB \\([1-9]/.test(t) && t")
    assert "in memory" in disk and "on disk" in disk and "written" in disk, disk
    # hovering a cell names its request, its positions and its timings
    tip = browser.execute_script("""
        const st = window.justapiDashboard, c = document.getElementById('timeline');
        const i = st.columns.findIndex(col => col.cells.some(x => x.kind === 'decode'));
        const cell = st.columns[i].cells.find(x => x.kind === 'decode');
        const rect = c.getBoundingClientRect(), scale = rect.width / c.width;
        const w = (c.width - 36) / 200, x = 36 + (200 - st.columns.length + i + 0.5) * w;
        const y = (cell.lane + 0.5) * Number(c.dataset.rowHeight);
        c.dispatchEvent(new MouseEvent('mousemove', {clientX: rect.left + x * scale, clientY: rect.top + y * scale}));
        return [cell.rid, document.getElementById('tip').textContent];""")
    assert tip[0] in tip[1] and "decode: positions" in tip[1] and "prompt" in tip[1]
    assert browser.execute_script("return window.justapiDashboard.errors") == []
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))
    problems = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert not problems, problems
