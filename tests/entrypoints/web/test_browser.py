"""The web UI in a real browser: headless Chromium (selenium) against a real ``kvflow serve``
process on SmolLM2 with ``--api-key``, with no network but 127.0.0.1.

The chat page asks for the key once and keeps it; a message streams a reply equal to the
API's (greedy); Stop aborts the request (the server's /metrics shows nothing running and
the KV cache idle again); the engine view shows the request's blocks in use during a long
generation and none after; Copy copies a reply; Markdown with highlighted code; a reply
cannot inject HTML or script; the chat fits 420 px and an empty chat at 1400x900 shows no
scrollbar; conversations are saved in the browser, Regenerate and Edit continue them; the
dashboard agrees with itself under 8 concurrent requests. No page requests a URL outside
the server. Screenshots go to $KVFLOW_TEST_ARTIFACTS (default: pytest's tmp dir).

Skips, saying why, without selenium, chromium or chromedriver (Debian: ``apt-get install -y
chromium chromium-driver``; .ci/run installs them where apt is available)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
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
    # The server's C++ kernels are built (or found in the cache) first: on a fresh checkout they
    # compile for minutes, and meanwhile the server answers on its fallback paths with the
    # compilers holding the CPU, which a 120 s wait for one reply did not always survive.
    subprocess.run([sys.executable, "-m", "kvflow.ops"], check=False, capture_output=True, timeout=1800)
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
    # (the dialog's submit handler runs after the click returns: under load, poll for it)
    stored = wait_until(lambda: driver.execute_script("return localStorage.getItem('kvflow.apiKey')"), TIMEOUT_S,
                        "the key in localStorage")
    assert stored == API_KEY
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


# ---------------------------------------------------------------------------- Markdown, highlighting
def test_markdown_renderer_in_the_browser(server, browser):
    driver, _ = browser
    driver.get(server + "/")
    out = driver.execute_async_script(
        """const done = arguments[arguments.length - 1];
        import('/ui/markdown.js').then((m) => {
          const d = document.createElement('div');
          d.innerHTML = m.renderMarkdown('**bold** and `a<b>` <script>alert(1)</script>\\n\\n1. one\\n2. two\\n\\n'
            + '| a | b |\\n|---|---|\\n| 1 | 2 |\\n\\n```python\\nprint("<hi>")\\n```');
          done({strong: d.querySelector('strong')?.textContent, code: d.querySelector('p code')?.textContent,
                text: d.querySelector('p').textContent, scripts: d.querySelectorAll('script').length,
                items: [...d.querySelectorAll('ol li')].map((li) => li.textContent), cells: d.querySelectorAll('td').length,
                lang: d.querySelector('.lang').textContent, cls: d.querySelector('pre code').className,
                src: d.querySelector('pre code').textContent, copy: !!d.querySelector('button.copy'),
                tokens: [...d.querySelectorAll('pre code span[class^="hljs-"]')].map((s) => s.className)});
        }, (e) => done(String(e)));"""
    )
    assert out["strong"] == "bold" and out["code"] == "a<b>" and out["scripts"] == 0
    assert "<script>alert(1)</script>" in out["text"]  # raw HTML shows as text
    assert out["items"] == ["one", "two"] and out["cells"] == 2
    assert out["lang"] == "python" and "language-python" in out["cls"] and out["copy"]
    assert out["src"] == 'print("<hi>")'
    assert "hljs-built_in" in out["tokens"] and "hljs-string" in out["tokens"], out["tokens"]  # highlighted


# ---------------------------------------------------------------------------- helpers for the tests below
def _open_chat(driver, server: str, *, conversations=None, width=1280, height=900) -> None:
    """The chat page at ``width`` x ``height`` CSS pixels with the key stored and, when given,
    ``conversations`` as the saved ones (the first one open)."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})  # fmt: skip
    driver.get(server + "/ui/favicon.svg")  # the origin, for localStorage
    driver.execute_script(
        "localStorage.setItem('kvflow.apiKey', arguments[0]);"
        "if (arguments[1]) { localStorage.setItem('kvflow.conversations', JSON.stringify(arguments[1]));"
        "  localStorage.setItem('kvflow.currentConversation', arguments[1][0].id); }"
        "else { localStorage.removeItem('kvflow.conversations'); localStorage.removeItem('kvflow.currentConversation'); }"
        "localStorage.setItem('kvflow.chatSettings', JSON.stringify({system: '', temperature: 0, top_p: 1, max_tokens: 8, seed: ''}));",
        API_KEY, conversations,
    )
    driver.get(server + "/")
    wait_until(lambda: driver.find_element("id", "model-name").get_attribute("textContent"), TIMEOUT_S, "the model name")


def _layout(driver) -> dict:
    """Overflow facts of the page: the document's and the scrolling boxes' sizes, and every
    visible element that sticks out of the viewport horizontally."""
    return driver.execute_script(
        """const de = document.documentElement, m = document.getElementById('messages');
        const out = [];
        for (const el of document.querySelectorAll('body *')) {
          const r = el.getBoundingClientRect();
          if (!r.width || getComputedStyle(el).visibility === 'hidden' || el.closest('pre, table, .conversations')) continue;
          if (r.left < -0.5 || r.right > de.clientWidth + 0.5) out.push(`${el.tagName}#${el.id}.${el.className} ${r.left}-${r.right}`);
        }
        return {scrollWidth: de.scrollWidth, clientWidth: de.clientWidth, scrollHeight: de.scrollHeight,
                clientHeight: de.clientHeight, messages: [m.scrollHeight, m.clientHeight, m.scrollWidth, m.clientWidth],
                settings: (() => { const s = document.getElementById('side-panel'); return [s.scrollHeight, s.clientHeight]; })(),
                outside: out.slice(0, 10)};"""
    )


LONG_REPLY = (
    "Here is a long line: " + "supercalifragilistic" * 8 + "\n\n```python\n"
    + "def f(x):\n    return [x * i for i in range(100)]  # a comment that is much wider than a phone screen is\n"
    + "```\n\n| column one | column two | column three | column four |\n|---|---|---|---|\n"
    + "| a long table cell | another long table cell | and a third one | the fourth |\n"
)  # fmt: skip


def _conversation(cid: str, title: str, messages) -> dict:
    return {"id": cid, "title": title, "updated": 1, "messages": [{"role": r, "content": c} for r, c in messages]}


# ---------------------------------------------------------------------------- layout
def test_chat_fits_a_phone_and_an_empty_chat_shows_no_scrollbar(server, browser, artifacts):
    driver, _ = browser
    try:
        saved = [_conversation("c-layout", "Layout", [("user", "Show me a wide reply. " + "word " * 60), ("assistant", LONG_REPLY)])]
        _open_chat(driver, server, conversations=saved, width=420, height=860)
        assert driver.find_elements("css selector", ".msg.assistant .code-block")
        layout = _layout(driver)
        driver.save_screenshot(str(artifacts / "chat-420.png"))
        assert layout["scrollWidth"] <= layout["clientWidth"] == 420, layout  # no horizontal scroll
        assert layout["outside"] == [], layout  # nothing cut: every element inside the 420 px
        assert layout["scrollHeight"] <= layout["clientHeight"], layout  # only the messages scroll
        composer = driver.find_element("id", "prompt").rect
        assert composer["x"] >= 0 and composer["x"] + composer["width"] <= 420
        assert driver.find_element("id", "send").is_displayed()
        # the conversations and settings: a panel over the chat, inside the screen
        assert not driver.find_element("id", "side-panel").is_displayed()
        driver.find_element("id", "panel-toggle").click()
        panel = driver.find_element("id", "side-panel").rect
        assert panel["x"] >= 0 and panel["x"] + panel["width"] <= 420
        assert _layout(driver)["scrollWidth"] <= 420
        driver.save_screenshot(str(artifacts / "chat-420-panel.png"))

        _open_chat(driver, server, width=1400, height=900)
        assert driver.find_element("id", "empty-hint").is_displayed()
        layout = _layout(driver)
        driver.save_screenshot(str(artifacts / "chat-1400-empty.png"))
        assert layout["scrollHeight"] <= layout["clientHeight"] and layout["scrollWidth"] <= layout["clientWidth"], layout
        assert layout["messages"][0] <= layout["messages"][1], layout  # the empty message list does not scroll
        assert layout["settings"][0] <= layout["settings"][1], layout  # nor does the side panel
        assert layout["outside"] == [], layout
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


# ---------------------------------------------------------------------------- injection
INJECTION = (
    'Hi <img src=x onerror="window.__pwned.push(1)"> <script>window.__pwned.push(2)</script>\n\n'
    "[click me](javascript:window.__pwned.push(3)) ![pic](x) <a href=\"javascript:window.__pwned.push(4)\">a</a>\n\n"
    '<iframe srcdoc="<script>parent.__pwned.push(5)</script>"></iframe> <svg onload="window.__pwned.push(6)"></svg>\n\n'
    '<div onmouseover="window.__pwned.push(7)" style="position:fixed;inset:0">cover</div>'
)  # fmt: skip


def test_a_reply_cannot_inject_html_or_script(server, browser, artifacts):
    """The reply arrives through the page's own stream reader: the page's fetch of
    /v1/chat/completions answers an SSE stream whose deltas carry the payload."""
    driver, _ = browser
    _open_chat(driver, server)
    driver.execute_script(
        """window.__pwned = [];
        const payload = arguments[0], real = window.fetch;
        window.fetch = (url, opts) => {
          if (!String(url).endsWith('/v1/chat/completions')) return real(url, opts);
          const chunk = (c) => `data: ${JSON.stringify({choices: [{index: 0, delta: {content: c}, finish_reason: null}]})}\\n\\n`;
          const parts = payload.match(/[\\s\\S]{1,7}/g).map(chunk).join('') +
            `data: ${JSON.stringify({choices: [{index: 0, delta: {}, finish_reason: 'stop'}]})}\\n\\ndata: [DONE]\\n\\n`;
          return Promise.resolve(new Response(parts, {status: 200, headers: {'Content-Type': 'text/event-stream'}}));
        };""",
        INJECTION,
    )
    _send(driver, "Say something dangerous.")
    reply = _last_reply(driver)
    wait_until(lambda: reply.get_attribute("data-done") == "done", TIMEOUT_S, "the injected reply")
    from selenium.webdriver import ActionChains

    body = reply.find_element("css selector", ".body")
    ActionChains(driver).move_to_element(body).click(body).perform()
    for link in body.find_elements("css selector", "a"):
        href = link.get_attribute("href") or ""
        assert not href.lower().startswith("javascript:"), href
    danger = driver.execute_script(
        "const b = arguments[0]; return [...b.querySelectorAll('img, script, iframe, svg, object, embed, style, [onerror], [onload], [onmouseover]')]"
        ".map((e) => e.outerHTML);", body)  # fmt: skip
    assert danger == []
    assert "<script>window.__pwned.push(2)</script>" in body.text  # shown as text
    time.sleep(0.5)
    assert driver.execute_script("return window.__pwned") == []
    driver.save_screenshot(str(artifacts / "chat-injection.png"))


# ---------------------------------------------------------------------------- conversations, regenerate, edit
def _spy_requests(driver) -> None:
    driver.execute_script(
        """window.__sent = []; const real = window.fetch;
        window.fetch = (url, opts) => { if (String(url).endsWith('/v1/chat/completions')) window.__sent.push(JSON.parse(opts.body)); return real(url, opts); };"""
    )


def _stored(driver) -> list[dict]:
    return driver.execute_script("return JSON.parse(localStorage.getItem('kvflow.conversations') || '[]')")


def _messages(driver) -> list[tuple[str, str]]:
    return [(el.get_attribute("class").split()[1], el.get_attribute("data-raw"))
            for el in driver.find_elements("css selector", "#messages .msg")]  # fmt: skip


def test_conversations_are_saved_and_regenerate_and_edit_continue_them(server, browser, artifacts):
    driver, _ = browser
    older = _conversation("c-older", "An older chat", [("user", "Hello?"), ("assistant", "Hello! How can I help?")])
    _open_chat(driver, server, conversations=[older])
    assert _messages(driver) == [("user", "Hello?"), ("assistant", "Hello! How can I help?")]  # reopened from storage
    driver.find_element("id", "new-chat").click()
    assert _messages(driver) == []
    _spy_requests(driver)
    _send(driver, "Name a color.")
    reply = _last_reply(driver)
    wait_until(lambda: reply.get_attribute("data-done") == "done", TIMEOUT_S, "the first reply")
    first = reply.get_attribute("data-raw")
    assert first.strip()
    stored = _stored(driver)
    assert [c["title"] for c in stored] == ["Name a color.", "An older chat"]
    assert [(m["role"], m["content"]) for m in stored[0]["messages"]] == [("user", "Name a color."), ("assistant", first)]

    # ---- it survives a reload: the same conversation open, the older one listed
    driver.refresh()
    wait_until(lambda: _messages(driver), TIMEOUT_S, "the saved conversation after a reload")
    assert _messages(driver) == [("user", "Name a color."), ("assistant", first)]
    listed = [li.text for li in driver.find_elements("css selector", "#conversations li .open")]
    assert listed == ["Name a color.", "An older chat"]
    driver.save_screenshot(str(artifacts / "chat-saved.png"))

    # ---- Regenerate: the same question asked again without the old reply, which is replaced
    _spy_requests(driver)
    driver.find_element("css selector", ".msg.assistant button[data-regenerate]").click()
    wait_until(lambda: len(_messages(driver)) == 2 and _last_reply(driver).get_attribute("data-done") == "done",
               TIMEOUT_S, "the regenerated reply")  # fmt: skip
    sent = driver.execute_script("return window.__sent")
    assert len(sent) == 1 and sent[0]["messages"] == [{"role": "user", "content": "Name a color."}]
    again = _last_reply(driver).get_attribute("data-raw")
    assert again.strip() and again == first  # greedy: the same reply, from a new request
    assert [(m["role"], m["content"]) for m in _stored(driver)[0]["messages"]] == [("user", "Name a color."), ("assistant", again)]

    # ---- Edit: the message replaced, the conversation continued from it
    driver.find_element("css selector", ".msg.user button[data-edit]").click()
    area = driver.find_element("css selector", ".edit-box textarea")
    area.clear()
    area.send_keys("Name a fruit.")
    driver.find_element("css selector", ".edit-box button[data-edit-save]").click()
    wait_until(lambda: len(_messages(driver)) == 2 and _last_reply(driver).get_attribute("data-done") == "done",
               TIMEOUT_S, "the reply to the edited message")  # fmt: skip
    sent = driver.execute_script("return window.__sent")
    assert len(sent) == 2 and sent[1]["messages"] == [{"role": "user", "content": "Name a fruit."}]
    edited = _last_reply(driver).get_attribute("data-raw")
    driver.refresh()
    wait_until(lambda: _messages(driver), TIMEOUT_S, "the edited conversation after a reload")
    assert _messages(driver) == [("user", "Name a fruit."), ("assistant", edited)]

    # ---- the older conversation opens from the list; deleting it removes it from storage
    driver.find_element("xpath", "//ul[@id='conversations']//button[@class='open' and text()='An older chat']").click()
    assert _messages(driver) == [("user", "Hello?"), ("assistant", "Hello! How can I help?")]
    driver.find_element("css selector", "#conversations li.active button.delete").click()
    assert [c["id"] for c in _stored(driver)] == [c["id"] for c in _stored(driver) if c["id"] != "c-older"]
    assert "c-older" not in [c["id"] for c in _stored(driver)] and len(_stored(driver)) == 1


# ---------------------------------------------------------------------------- the dashboard under load
def test_dashboard_agrees_with_itself_under_8_concurrent_requests(server, browser, artifacts):
    driver, _ = browser
    _open_chat(driver, server)
    driver.get(server + "/dashboard")
    wait_until(lambda: driver.execute_script("return document.body.dataset.seq"), TIMEOUT_S, "the first snapshot")
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            httpx.post(server + "/v1/completions", headers=AUTH, timeout=TIMEOUT_S * 3, json={
                "prompt": f"Request {i}: count slowly from one to one hundred.", "max_tokens": 32,
                "ignore_eos": True, "temperature": 0}).raise_for_status()  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    read = """const rows = document.querySelectorAll('#running tbody tr').length;
        const wrows = document.querySelectorAll('#waiting tbody tr').length;
        return {status: document.getElementById('num-running').textContent, waiting: document.getElementById('num-waiting').textContent,
                rows, wrows, sub: document.getElementById('running-sub').textContent,
                chart: document.getElementById('now-reqs').textContent, seq: document.body.dataset.seq};"""
    samples, busiest = [], 0
    while any(t.is_alive() for t in threads):
        v = driver.execute_script(read)
        samples.append(v)
        if v["status"] not in ("", "–"):
            running, waiting = int(v["status"]), int(v["waiting"])
            if running >= busiest and running > 1:
                busiest = running
                driver.save_screenshot(str(artifacts / "dashboard-8-requests.png"))
            assert v["rows"] == running and v["wrows"] == waiting, v
            assert v["sub"].startswith(f"{running} /"), v
            assert v["chart"] == f"{running} running · {waiting} waiting", v  # the Requests chart: the same snapshot
        time.sleep(0.15)
    for t in threads:
        t.join()
    assert errors == []
    assert busiest >= 2, samples[-5:]  # the samples did see concurrent requests
    wait_until(lambda: driver.find_element("id", "num-running").text == "0", TIMEOUT_S, "the dashboard to go idle")
    assert driver.find_element("id", "now-reqs").text == "0 running · 0 waiting"
