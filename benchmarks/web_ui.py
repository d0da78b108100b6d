"""Screenshots of kvflow's web UI under load: the chat playground (``/``) and the live engine
view (``/dashboard``) while 16 chat requests sharing one long system prompt run at once.

What it does
------------
Starts ``kvflow serve`` (127.0.0.1, a free port), sends one request with the shared system
prompt first (so that its full KV blocks are in the prefix index), then 15 concurrent
streaming chat requests over httpx plus a 16th typed into the chat page by headless
Chromium, all with the same system prompt (the first ``--system-tokens`` tokens of
``/usr/share/common-licenses/GPL-3``) and different user questions. While they generate
it screenshots the chat page (the reply streaming) and the engine view (the block grid
with the system prompt's blocks shared by the 16 requests and their ref count, the batch,
the queues and the metric charts), the second one with the mouse over a shared block so
that the tooltip (owners, the block's text) shows. Chromium runs with no network but
127.0.0.1 (``--host-resolver-rules``); every URL the pages requested is checked to be the
server's and listed in the JSON summary.

How to run
----------
    python -m benchmarks.web_ui --out-dir /tmp/kvflow-ui      # needs chromium + chromium-driver, selenium

Writes ``chat.png``, ``dashboard.png`` and ``web_ui.json`` (what the pages showed, the
requests' usage, the URLs requested) to ``--out-dir``.

The browser helpers here (``browser_missing``, ``headless_chromium``, ``NetworkLog``) are
also used by the browser test (tests/entrypoints/web/test_browser.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serving import GPL3, start_server, stop_server

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
QUESTIONS = [
    "Summarize this license in one paragraph.", "Who may copy the program?", "What is the source code?",
    "What does 'convey' mean here?", "Can I sell copies?", "What about patents?", "Is there a warranty?",
    "What must I keep when I modify it?", "What is an aggregate?", "What is a User Product?",
    "How do I terminate the license?", "Does it cover network use?", "What are installation information?",
    "Can I add terms?", "What is the preamble about?", "Explain the license to a programmer, section by section.",
]  # fmt: skip


# ---------------------------------------------------------------------------- the browser
def browser_missing() -> str | None:
    """Why headless Chromium cannot be driven here (a sentence naming what to install), or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium; it is in the test extra)"
    if not any(shutil.which(name) for name in CHROMIUM_NAMES):
        return "no chromium binary on PATH (Debian: apt-get install -y chromium chromium-driver)"
    if not shutil.which("chromedriver"):
        return "no chromedriver on PATH (Debian: apt-get install -y chromium-driver)"
    return None


def headless_chromium(width: int = 1440, height: int = 1000):
    """A selenium Chrome driver for headless Chromium that can reach 127.0.0.1 only: every
    other host name resolves to nothing (``--host-resolver-rules``), no proxy, and Chromium's
    own background traffic (updates, sync, safe browsing, translation) is off. The DevTools
    network log is on (read it with ``NetworkLog``). Raises RuntimeError if ``browser_missing()``."""
    missing = browser_missing()
    if missing:
        raise RuntimeError(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = next(shutil.which(n) for n in CHROMIUM_NAMES if shutil.which(n))
    for arg in (
        "--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", f"--window-size={width},{height}",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--no-proxy-server",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-default-apps",
        "--disable-features=Translate,OptimizationHints,MediaRouter,SafeBrowsing", "--no-first-run",
        "--no-default-browser-check", "--metrics-recording-only", "--disable-client-side-phishing-detection",
    ):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


class NetworkLog:
    """The URLs the driver's pages requested (DevTools ``Network.requestWillBeSent``) and the
    console messages, accumulated across reads (the driver hands each log entry out once)."""

    def __init__(self, driver) -> None:
        self.driver = driver
        self.urls: list[str] = []
        self.console: list[dict] = []

    def read(self) -> NetworkLog:
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message.get("method") == "Network.requestWillBeSent":
                self.urls.append(message["params"]["request"]["url"])
        self.console += self.driver.get_log("browser")
        return self

    def foreign(self, origin: str) -> list[str]:
        """The requested URLs that are neither under ``origin`` nor data:/blob: URLs."""
        self.read()
        return [u for u in self.urls if not (u == origin or u.startswith(origin + "/") or u.startswith(("data:", "blob:")))]


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll ``predicate`` until it returns a truthy value (returned); TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def hover_shared_block(driver) -> str | None:
    """Move the (synthetic) mouse over the engine view's grid until the tooltip shows a block
    shared by several requests; the tooltip's text, or None if no block is shared."""
    return driver.execute_script(
        """
        const canvas = document.getElementById("block-grid"), tip = document.getElementById("tooltip");
        const r = canvas.getBoundingClientRect();
        for (let y = r.top + 3; y < r.bottom; y += 4) for (let x = r.left + 3; x < r.right; x += 4) {
          canvas.dispatchEvent(new MouseEvent("mousemove", {clientX: x, clientY: y, bubbles: true}));
          if (tip.style.display === "block" && tip.textContent.includes("shared")) return tip.textContent;
        }
        return null;"""
    )


# ---------------------------------------------------------------------------- the run
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.web_ui", description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=None, help="where the PNGs and JSON go (default: a new temporary folder)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--system-tokens", type=int, default=480, help="length of the shared system prompt, in tokens")
    p.add_argument("--settle", type=float, default=15.0, help="seconds between 16 running and the screenshots")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens each request generates (ignore_eos)")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads of the server")
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    args.max_num_seqs, args.max_num_batched_tokens, args.dtype = 16, None, None
    return args


def system_prompt(model: str, num_tokens: int) -> str:
    from kvflow.model.resolve import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(model))
    ids = tokenizer.encode(GPL3.read_text(), add_special_tokens=False)[:num_tokens]
    return "You answer questions about this license.\n\n" + tokenizer.decode(ids)


async def _chat(client: httpx.AsyncClient, system: str, question: str, max_tokens: int) -> dict:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens, "temperature": 0.7, "seed": len(question), "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    usage = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[5:])
                usage = chunk.get("usage") or usage
    return usage


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = browser_missing()
    if missing:
        raise SystemExit(f"error: {missing}")
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="kvflow-ui-"))
    out.mkdir(parents=True, exist_ok=True)
    system = system_prompt(args.model, args.system_tokens)
    proc, url, log = start_server(args, out / "server.log")
    summary: dict[str, Any] = {"url": url, "system_prompt_chars": len(system), "max_tokens": args.max_tokens}
    try:
        return _run(args, out, url, system, summary)
    finally:
        stop_server(proc, log)


def _run(args: argparse.Namespace, out: Path, url: str, system: str, summary: dict[str, Any]) -> int:
    chat = dash = None
    try:
        # Fill the prefix index with the system prompt's blocks (one short request).
        asyncio.run(_one_request(url, system, "Hello.", 1))
        chat, dash = headless_chromium(), headless_chromium(1440, 1640)  # the engine view with its charts
        chat_log, dash_log = NetworkLog(chat), NetworkLog(dash)
        dash.get(url + "/dashboard")
        wait_until(lambda: dash.execute_script("return document.body.dataset.seq"), 60, "the first snapshot")
        chat.get(url + "/")
        chat.execute_script(
            "localStorage.setItem('kvflow.chatSettings', JSON.stringify(arguments[0])); location.reload();",
            {"system": system, "temperature": 0.7, "top_p": 1, "max_tokens": args.max_tokens, "seed": 1},
        )
        wait_until(lambda: chat.find_element("id", "model-name").text, 60, "the chat page's model name")

        results: list[Any] = []
        background = threading.Thread(
            target=lambda: results.extend(asyncio.run(_many(url, system, QUESTIONS[:15], args.max_tokens))), daemon=True
        )
        background.start()
        prompt = chat.find_element("id", "prompt")
        prompt.send_keys(QUESTIONS[15])
        chat.find_element("id", "send").click()
        wait_until(lambda: int(dash.find_element("id", "num-running").text or 0) >= 16, 300, "16 running requests")
        time.sleep(args.settle)  # some seconds of history in the metric charts
        tooltip = wait_until(lambda: hover_shared_block(dash), 60, "a shared block under the mouse")
        time.sleep(0.6)  # the tooltip's text comes from /dashboard/api/blocks/{id}
        dash.save_screenshot(str(out / "dashboard.png"))
        reply = chat.find_element("css selector", ".msg.assistant")
        wait_until(lambda: len(reply.text) > 200 or reply.get_attribute("data-done"), 300, "the chat reply to stream")
        chat.save_screenshot(str(out / "chat.png"))
        shown = {i: dash.find_element("id", i).text for i in
                 ("num-running", "num-waiting", "kv-usage", "count-free", "count-cached", "count-used", "count-shared",
                  "pool-sub", "batch-sub")}  # fmt: skip
        summary.update(dashboard=shown, tooltip=dash.find_element("id", "tooltip").text or tooltip,
                       chat_reply=chat.find_element("css selector", ".msg.assistant .body").text)  # fmt: skip
        background.join(600)
        wait_until(lambda: chat.find_elements("css selector", ".msg.assistant[data-done]"), 300, "the chat reply's end")
        summary["chat_stats"] = chat.find_element("css selector", ".msg.assistant .stats").text
        summary["usage"] = results
        summary["foreign_urls"] = sorted(set(chat_log.foreign(url) + dash_log.foreign(url)))
        summary["requested_urls"] = sorted(set(chat_log.urls + dash_log.urls))
        summary["prefix_cache_hit_rate"] = _metric(url, "kvflow:prefix_cache_hits_total") / max(
            _metric(url, "kvflow:prefix_cache_queries_total"), 1.0
        )
    except BaseException:
        for name, driver in (("chat", chat), ("dashboard", dash)):
            if driver is not None:
                driver.save_screenshot(str(out / f"{name}-at-failure.png"))
        raise
    finally:
        for driver in (chat, dash):
            if driver is not None:
                driver.quit()
    (out / "web_ui.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("usage", "requested_urls")}, indent=2))
    print(f"screenshots: {out / 'chat.png'} {out / 'dashboard.png'}")
    if summary["foreign_urls"]:
        print(f"error: the pages requested URLs outside {url}: {summary['foreign_urls']}")
        return 1
    return 0


async def _one_request(url: str, system: str, question: str, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return await _chat(client, system, question, max_tokens)


async def _many(url: str, system: str, questions: list[str], max_tokens: int) -> list[dict]:
    limits = httpx.Limits(max_connections=len(questions) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        return await asyncio.gather(*(_chat(client, system, q, max_tokens) for q in questions))


if __name__ == "__main__":
    raise SystemExit(main())
