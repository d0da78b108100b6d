"""The web UI in a real browser: headless Chromium (selenium) against a real ``kvflow serve``
process on SmolLM2 with ``--api-key``, with no network but 127.0.0.1.

The chat page asks for the key once and keeps it; a message streams a reply equal to the
API's (greedy); Stop aborts the request (the server's /metrics shows nothing running and
the KV cache idle again); the engine view shows the request's blocks in use during a long
generation and none after; Copy copies a reply; the Markdown renderer escapes HTML. No page requests a URL
outside the server. Screenshots go to $KVFLOW_TEST_ARTIFACTS (default: pytest's tmp dir).

Skips, saying why, without selenium, chromium or chromedriver (Debian: ``apt-get install -y
chromium chromium-driver``; .ci/run installs them where apt is available)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import httpx
import pytest

from benchmarks.serving import start_server, stop_server
from benchmarks.web_ui import NetworkLog, browser_missing, headless_chromium, wait_until
from conftest import requires_smollm2

pytestmark = [
    requires_smollm2,
    pytest.mark.integration,
    pytest.mark.skipif(browser_missing() is not None, reason=f"browser test: {browser_missing()}"),
]

API_KEY = "sk-browser"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TIMEOUT_S = 120  # any single wait (the machine is shared and slow)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    path = Path(os.environ.get("KVFLOW_TEST_ARTIFACTS") or tmp_path_factory.mktemp("browser"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def server(smollm2_dir, artifacts):
    args = argparse.Namespace(model=str(smollm2_dir), num_threads=1, num_kv_blocks=256, max_num_seqs=4,
                              max_num_batched_tokens=None, dtype=None, startup_timeout=180)  # fmt: skip
    proc, url, log = start_server(args, artifacts / "server.log", ("--api-key", API_KEY))
    yield url
    stop_server(proc, log)
    assert "Traceback" not in (artifacts / "server.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def browser(server):
    driver = headless_chromium(1280, 900)
    driver.set_script_timeout(TIMEOUT_S)
    log = NetworkLog(driver)
    yield driver, log
    try:
        foreign = log.foreign(server)
        errors = [m["message"] for m in log.console if m["level"] == "SEVERE" and " 401 " not in m["message"]]
    finally:
        driver.quit()
    assert foreign == [], f"the pages requested URLs outside {server}: {foreign}"
    assert log.urls and all(u.startswith(server) for u in log.urls if not u.startswith("data:"))
    assert errors == [], errors  # (the 401 of the first /v1/models, before the key was entered, is expected)


def _metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics", headers=AUTH, timeout=10).text.splitlines():
        m = re.match(r"(kvflow:\w+)(?:\{[^}]*\})? (\S+)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


def _set(driver, element_id: str, value) -> None:
    """Type ``value`` into an input (fires input + change, as a user would)."""
    el = driver.find_element("id", element_id)
    el.clear()
    el.send_keys(str(value))
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", el)


def _last_reply(driver):
    return driver.find_elements("css selector", ".msg.assistant")[-1]


def _send(driver, text: str) -> None:
    driver.find_element("id", "prompt").send_keys(text)
    driver.find_element("id", "send").click()


def test_chat_streams_stop_aborts_and_the_engine_view_follows(server, browser, artifacts):
    driver, _ = browser
    driver.get(server + "/")
    # /v1/models answered 401: the key dialog is open; the key entered is kept in localStorage
    dialog = wait_until(lambda: driver.find_elements("id", "key-dialog"), TIMEOUT_S, "the API-key dialog")[0]
    assert dialog.get_attribute("open") is not None
    driver.find_element("id", "key-input").send_keys(API_KEY)
    driver.find_element("id", "key-save").click()
    assert driver.execute_script("return localStorage.getItem('kvflow.apiKey')") == API_KEY
    model = wait_until(lambda: driver.find_element("id", "model-name").text, TIMEOUT_S, "the model name")
    assert "context" in model
    driver.refresh()  # the key survives a reload: no dialog this time
    wait_until(lambda: driver.find_element("id", "model-name").text, TIMEOUT_S, "the model name after a reload")
    assert not driver.find_elements("css selector", "#key-dialog[open]")

    # ---- a greedy reply streams (rendered more than once) and equals the API's
    _set(driver, "temperature", 0)
    _set(driver, "max_tokens", 24)
    _set(driver, "system", "You are a concise assistant.")
    driver.execute_script(
        "window.__renders = 0; new MutationObserver(() => window.__renders++)"
        ".observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});"
    )
    _send(driver, "Name three fruits.")
    reply = _last_reply(driver)
    wait_until(lambda: reply.get_attribute("data-done") == "done", TIMEOUT_S, "the reply to finish")
    raw = reply.get_attribute("data-raw")
    expected = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=TIMEOUT_S, json={
        "messages": [{"role": "system", "content": "You are a concise assistant."},
                     {"role": "user", "content": "Name three fruits."}],
        "max_tokens": 24, "temperature": 0,
    }).json()["choices"][0]  # fmt: skip
    assert raw == expected["message"]["content"] and raw.strip()
    assert driver.execute_script("return window.__renders") > 3  # streamed: the body changed piece by piece
    stats = reply.find_element("css selector", ".stats").text
    assert re.fullmatch(rf"TTFT \d+\.\d\d s · \d+\.\d tok/s · \d+ tokens · finish: {expected['finish_reason']}", stats), stats
    driver.save_screenshot(str(artifacts / "chat-reply.png"))
    # the Copy button puts the reply's Markdown on the clipboard
    driver.execute_cdp_cmd("Browser.grantPermissions", {"origin": server,
                           "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})  # fmt: skip
    copy = reply.find_element("css selector", "button[data-copy-message]")
    copy.click()
    wait_until(lambda: copy.text == "Copied", TIMEOUT_S, "the Copy button to say Copied")
    pasted = driver.execute_async_script("navigator.clipboard.readText().then(arguments[0], (e) => arguments[0]('!' + e))")
    assert pasted == raw

    # ---- the engine view in a second window (same browser: the key is already stored)
    chat_window = driver.current_window_handle
    driver.switch_to.new_window("window")
    dash_window = driver.current_window_handle
    driver.get(server + "/dashboard")
    wait_until(lambda: driver.execute_script("return document.body.dataset.seq"), TIMEOUT_S, "the first snapshot")
    assert driver.find_element("id", "count-used").text == "0" and driver.find_element("id", "num-running").text == "0"

    # ---- a long generation: its blocks in use on the dashboard, then Stop
    driver.switch_to.window(chat_window)
    _set(driver, "max_tokens", 2000)
    _send(driver, "Write a long story about a dragon who learns to read.")
    reply = _last_reply(driver)
    wait_until(lambda: len(reply.find_element("css selector", ".body").text) > 20, TIMEOUT_S, "the long reply to start")
    assert driver.find_element("id", "stop").is_displayed() and not driver.find_element("id", "send").is_enabled()
    driver.switch_to.window(dash_window)
    in_use = lambda: int(driver.find_element("id", "count-used").text) + int(driver.find_element("id", "count-shared").text)  # noqa: E731
    wait_until(lambda: driver.find_element("id", "num-running").text == "1" and in_use() > 0, TIMEOUT_S,
               "the dashboard to show the running request's blocks")  # fmt: skip
    assert driver.find_element("css selector", "#running tbody tr")
    driver.save_screenshot(str(artifacts / "dashboard-busy.png"))
    busy = _metrics(server)
    assert busy["kvflow:num_requests_running"] == 1 and busy["kvflow:kv_cache_usage_perc"] > 0

    driver.switch_to.window(chat_window)
    driver.find_element("id", "stop").click()
    wait_until(lambda: reply.get_attribute("data-done") == "stopped", TIMEOUT_S, "the reply to stop")
    assert "finish: stopped" in reply.find_element("css selector", ".stats").text
    assert driver.find_element("id", "send").is_enabled()
    driver.save_screenshot(str(artifacts / "chat-stopped.png"))
    # closing the stream aborted the request on the server: nothing running, the KV cache idle
    idle = wait_until(lambda: (m := _metrics(server))["kvflow:num_requests_running"] == 0 and m, TIMEOUT_S, "idle /metrics")
    assert idle["kvflow:kv_cache_usage_perc"] == 0 and idle["kvflow:num_requests_waiting"] == 0
    generated = idle["kvflow:generation_tokens_total"] - busy["kvflow:generation_tokens_total"]
    assert generated < 1500, generated  # it did not run to its 2000 tokens
    driver.switch_to.window(dash_window)
    wait_until(lambda: driver.find_element("id", "num-running").text == "0" and in_use() == 0, TIMEOUT_S,
               "the dashboard to show every block free or cached")  # fmt: skip
    assert int(driver.find_element("id", "count-cached").text) > 0  # the prompts' full blocks stay in the prefix index
    driver.save_screenshot(str(artifacts / "dashboard-idle.png"))
    driver.close()
    driver.switch_to.window(chat_window)


MARKDOWN_CASES = [
    ("**bold** and `a<b>` <script>alert(1)</script>",
     "<p><strong>bold</strong> and <code>a&lt;b&gt;</code> &lt;script&gt;alert(1)&lt;/script&gt;</p>"),
    ("1. one\n2. two", "<ol><li>one</li><li>two</li></ol>"),
    ("[x](javascript:alert(1))", "<p>[x](javascript:alert(1))</p>"),
]  # fmt: skip


def test_markdown_renderer_in_the_browser(server, browser):
    driver, _ = browser
    driver.get(server + "/")
    rendered = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "import('/ui/markdown.js').then((m) => done(arguments[0].map((t) => m.renderMarkdown(t))), (e) => done(String(e)));",
        [text for text, _ in MARKDOWN_CASES],
    )
    assert rendered == [html for _, html in MARKDOWN_CASES]
    code = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "import('/ui/markdown.js').then((m) => { const d = document.createElement('div');"
        "d.innerHTML = m.renderMarkdown('```python\\nprint(\"<hi>\")\\n```'); done([d.querySelector('.lang').textContent,"
        "d.querySelector('code').className, d.querySelector('code').textContent, !!d.querySelector('button.copy')]); });"
    )
    assert code == ["python", "language-python", 'print("<hi>")', True]
