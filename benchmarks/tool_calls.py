"""How many tool-using chat replies of a served model parse into calls (docs/tools.md).

Starts ``kvflow serve`` from a checkout (``--root``, default this one) on ``--model``,
sends ``-n`` chat requests with two tools (``get_price``, ``convert_currency``) at
temperature 0.8 (seed = the request's index) and sorts the replies: calls parsed (named
tools, JSON-object arguments, nothing of a call in the content), call attempts lost (a call
left in the content, or a call naming no tool), plain answers.

    python -m benchmarks.tool_calls --model qwen2.5-coder-0.5b -n 16
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TOOLS = [
    {"type": "function", "function": {"name": "get_price", "description": "The price of a product in US dollars.",
     "parameters": {"type": "object", "properties": {"product": {"type": "string"}}, "required": ["product"]}}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount of money between currencies.",
     "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "from_currency": {"type": "string"},
                    "to_currency": {"type": "string"}}, "required": ["amount", "from_currency", "to_currency"]}}},
]  # fmt: skip
QUESTIONS = [
    "How much does a laptop cost in euros?", "What is the price of a bicycle in yen?",
    "Look up the price of a coffee machine and tell me it in pounds.", "Convert 250 dollars to euros.",
    "What does a phone cost? Answer in Swiss francs.", "I need the price of a desk in Canadian dollars.",
    "Find the price of headphones, then convert it to euros.", "How many euros is the price of a camera?",
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the kvflow checkout to serve")
    ap.add_argument("--max-tokens", type=int, default=120)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", "--model", args.model, "--port", str(port),
         "--max-num-seqs", "8", "--num-threads", "2", "--log-level", "warning"],
        cwd=args.root, env={**os.environ, "PYTHONPATH": args.root},
    )  # fmt: skip
    try:
        while True:
            if proc.poll() is not None:
                sys.exit("the server exited")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(2)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

        def one(i: int) -> dict:
            body = {"model": model, "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                    "tools": TOOLS, "temperature": 0.8, "seed": i, "max_tokens": args.max_tokens}  # fmt: skip
            return httpx.post(url + "/v1/chat/completions", json=body, timeout=1800).json()["choices"][0]["message"]

        start = time.time()
        with cf.ThreadPoolExecutor(8) as pool:
            messages = list(pool.map(one, range(args.n)))
        names = {t["function"]["name"] for t in TOOLS}
        parsed = lost = plain = 0
        for m in messages:
            content, calls = m.get("content") or "", m.get("tool_calls") or []
            in_content = '"name"' in content or "<tool_call>" in content or '"arguments"' in content
            good = bool(calls) and all(c["function"]["name"] in names and isinstance(json.loads(c["function"]["arguments"]), dict)
                                       for c in calls)  # fmt: skip
            if good and not in_content:
                parsed += 1
            elif calls or in_content:
                lost += 1
                print("lost:", json.dumps(m)[:300])
            else:
                plain += 1
        print(f"{args.n} replies in {time.time() - start:.0f} s: {parsed} calls parsed, {lost} call attempts lost, "
              f"{plain} plain answers")
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
