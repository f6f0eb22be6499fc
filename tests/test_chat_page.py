"""The chat page (/chat, server.chat_page) in headless Chromium: behind --api-key (the browser's Basic password,
then the page's own requests with it), a message sent and its streamed answer shown with its speed, a reasoning
model's thinking folded away, a long answer stopped (the server aborts it), and no console error."""

from __future__ import annotations

import httpx
import pytest

from server_helpers import InProcessServer, labelled, wait_until
from tiny_gguf import OPENING_TEMPLATE, write_tiny_model

KEY = "chat-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tiny Qwen3 whose template opens the thinking (its random answer never closes it: all of it reasoning)."""
    folder = tmp_path_factory.mktemp("chat")
    path = write_tiny_model(str(folder / "thinker.gguf"), "qwen3", seed=9, chat_template=OPENING_TEMPLATE,
                            context_length=1024)
    srv = InProcessServer(["--model", path, "--pool-blocks", "128", "--api-key", KEY], str(folder / "log"))
    yield srv
    srv.stop()


def page(browser, script: str, timeout_s: float = 60):
    return wait_until(lambda: browser.execute_script(script), timeout_s, f"the page's {script}")


def test_chat_in_chromium(server, browser, tmp_path):
    assert httpx.get(server.url + "/chat").status_code == 401  # the browser then asks for the key
    for path in ("/healthz", "/chat/x", "/chatty", "/dashboardx"):  # open and page paths are whole segments
        assert httpx.get(server.url + path).status_code == 401, path
    host = server.url.removeprefix("http://")
    browser.get_log("browser")  # the shared browser's earlier pages' entries, drained
    browser.get(f"http://user:{KEY}@{host}/chat")
    page(browser, "return document.querySelectorAll('#model option').length > 0")
    assert browser.execute_script("return document.querySelector('#model').value") == "thinker"

    browser.find_element("id", "temperature").clear()
    browser.find_element("id", "temperature").send_keys("0")  # greedy: this random model then never ends early
    browser.find_element("id", "max-tokens").clear()
    browser.find_element("id", "max-tokens").send_keys("12")
    browser.find_element("id", "prompt").send_keys("hello there\n")
    page(browser, "return window.justapiChat.turns === 1")
    turn = "document.querySelector('.turn.assistant')"
    assert browser.execute_script(f"return {turn}.querySelector('details').open") is False  # folded
    assert browser.execute_script(f"return {turn}.querySelector('details').textContent.length") > len("thinking")
    assert "12 tokens" in browser.execute_script(f"return {turn}.querySelector('.meta').textContent")
    assert "tok/s" in browser.execute_script(f"return {turn}.querySelector('.meta').textContent")

    browser.find_element("id", "clear").click()  # a new conversation
    assert browser.execute_script("return document.querySelectorAll('.turn').length") == 0
    browser.find_element("id", "max-tokens").clear()
    browser.find_element("id", "max-tokens").send_keys("900")
    browser.find_element("id", "prompt").send_keys("tell me a long story\n")
    page(browser, f"return {turn} && {turn}.textContent.length > 40")
    browser.find_element("id", "stop").click()
    page(browser, "return window.justapiChat.turns === 2")
    assert "stopped after" in browser.execute_script(f"return {turn}.querySelector('.meta').textContent")
    auth = {"Authorization": f"Bearer {KEY}"}
    aborted = lambda: labelled(httpx.get(server.url + "/metrics", headers=auth).text,  # noqa: E731
                               "justapi_requests_finished_total", finish_reason="abort")
    wait_until(lambda: aborted() == 1, 30, "the stopped answer aborted on the server")
    assert browser.execute_script("return window.justapiChat.errors") == 0
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and host in e["message"]]
    assert browser.save_screenshot(str(tmp_path / "chat.png"))
