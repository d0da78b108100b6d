"""Online serving latency of ``kvflow serve`` under Poisson request arrivals.

What it measures
----------------
For each request rate (``--rates``, requests per second) ``--num-requests`` streaming
completions are sent to the OpenAI-compatible server with Poisson arrivals (exponential gaps,
fixed seed), whether or not earlier ones have finished. Each prompt is a window of real text
(``/usr/share/common-licenses/GPL-3`` tokenized with the model's tokenizer, sent as token
ids so that its length is exact), prompt lengths uniform in 32-256 tokens, output lengths
uniform in 32-128 tokens; sampling is greedy with ``ignore_eos: true`` (the vLLM extra
field), so every request produces exactly its output length (checked against the final
``usage`` chunk of ``stream_options.include_usage``). The same workload (same prompts, same
arrival gaps scaled by the rate) runs at every rate.

Per request, on the client (httpx async, one connection per in-flight request):

* **TTFT**: request sent -> first SSE chunk carrying text;
* **TPOT**: (e2e - TTFT) / (output tokens - 1);
* **ITL**: every gap between consecutive text chunks (a chunk can carry more than one token
  when the detokenizer holds text back, as in vLLM's benchmark);
* **E2E**: request sent -> ``[DONE]``.

Per rate: p50 / p90 / p99 of each (over successful requests; ITL over all gaps), the
duration (first send -> last completion), completed requests/s and output tokens/s, failed
requests (HTTP error or ``--request-timeout``), and the CPU time other processes took
meanwhile (``other_load_cores``: all CPUs' busy time minus this client's and, when started
here, the server's, per wall second; near 0 means the run had the machine to itself; with
``--base-url`` it includes the server) and the server's own (``server_cpu_cores``).

How to run
----------
    python -m benchmarks.serving                                   # rates 1,2,4; 40 requests each
    python -m benchmarks.serving --rates 0.5,1,2 --num-requests 12 # a quick run
    python -m benchmarks.serving --base-url http://127.0.0.1:8000  # against a running server

Without ``--base-url`` a server subprocess is started on 127.0.0.1 (a free port) with the
engine flags given here and stopped at the end. Prints one table and writes every number
to ``--out`` (JSON, default ``benchmarks/results/serving.json``) and a plot of the latency
percentiles against the request rate to ``--plot`` (PNG; needs matplotlib, in the ``bench``
extra). Client and server share the machine: on a 2-core CPU the client's own work shows up
in the latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import OtherLoad, cpu_busy_fraction, format_table, machine_info, tokenize_corpus

GPL3 = Path("/usr/share/common-licenses/GPL-3")
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    """One request's measurements (seconds); ``error`` set when it failed."""

    index: int
    prompt_len: int
    output_len: int
    send_time: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="model to serve, and whose tokenizer makes the prompts")
    p.add_argument("--base-url", default=None, help="use this running server (http://host:port) instead of starting one")
    p.add_argument("--rates", default="1,2,4", help="comma-separated request rates, req/s (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=40, help="requests per rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: %(default)s)")
    p.add_argument("--min-prompt-len", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--min-output-len", type=int, default=32)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for the server")
    p.add_argument("--out", default="benchmarks/results/serving.json", help="JSON output (default: %(default)s)")
    p.add_argument("--plot", default="benchmarks/results/serving.png", help="PNG output, '' for none (default: %(default)s)")
    g = p.add_argument_group("server started here (ignored with --base-url)")
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads of the server")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--dtype", default=None)
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not args.rates or any(r <= 0 for r in args.rates):
        p.error("--rates must be positive numbers")
    if args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    return args


# ---------------------------------------------------------------------------- workload
def make_requests(tokenizer: Any, args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request: GPL-3 windows at random offsets."""
    ids = tokenize_corpus(tokenizer, (GPL3,))[GPL3.name]
    if len(ids) < args.max_prompt_len:
        raise ValueError(f"{GPL3} has only {len(ids)} tokens")
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.num_requests):
        n = rng.randint(args.min_prompt_len, args.max_prompt_len)
        start = rng.randint(0, len(ids) - n)
        requests.append((ids[start : start + n], rng.randint(args.min_output_len, args.max_output_len)))
    return requests


def arrival_gaps(n: int, seed: int) -> list[float]:
    """Poisson arrivals at rate 1: exponential gaps (the first request goes at once)."""
    rng = random.Random(seed + 1)
    return [0.0] + [rng.expovariate(1.0) for _ in range(n - 1)]


# ---------------------------------------------------------------------------- server
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, log_path: Path, extra_args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, Any]:
    """``kvflow serve`` on 127.0.0.1 (a free port) with ``args``' engine flags and ``extra_args``;
    (process, base URL, open log file) once /health answers. Raises RuntimeError if it exits
    or is not healthy within ``args.startup_timeout`` seconds."""
    port = _free_port()
    cmd = [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    for flag in ("num_threads", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "dtype"):
        value = getattr(args, flag)
        if value is not None:
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    cmd += list(extra_args)
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while True:
        if proc.poll() is not None:
            log.close()
            raise RuntimeError(f"server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc, log)
            raise RuntimeError(f"server not healthy after {args.startup_timeout}s; see {log_path}")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen, log: Any) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    log.close()


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_server_idle(url: str, timeout_s: float = 60.0) -> None:
    """Until /metrics shows no running or waiting request (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = httpx.get(url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            return
        busy = 0.0
        for line in text.splitlines():
            if line.startswith(("kvflow:num_requests_running", "kvflow:num_requests_waiting")):
                busy += float(line.rsplit(" ", 1)[1])
        if busy == 0:
            return
        time.sleep(0.5)


# ---------------------------------------------------------------------------- client
async def send_one(client: httpx.AsyncClient, url: str, model: str, result: Result, prompt: list[int], timeout: float) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": result.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result.send_time = start

    async def consume() -> None:
        last = None
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                now = time.perf_counter()
                if data == "[DONE]":
                    result.e2e = now - start
                    return
                chunk = json.loads(data)
                if "usage" in chunk:
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now

    try:
        await asyncio.wait_for(consume(), timeout)
    except asyncio.TimeoutError:
        result.error = f"timeout after {timeout}s"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    if result.error is None and (result.e2e is None or result.ttft is None):
        result.error = "stream ended without [DONE] or without text"
    if result.error is None and result.output_tokens != result.output_len:
        result.error = f"got {result.output_tokens} output tokens, asked for {result.output_len}"


async def run_rate(url: str, model: str, requests, gaps: list[float], rate: float, timeout: float) -> tuple[list[Result], float]:
    """Send every request at its Poisson arrival time; (results, duration in seconds)."""
    results = [Result(i, len(p), out) for i, (p, out) in enumerate(requests)]
    limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=len(requests) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as client:
        tasks = []
        t0 = time.perf_counter()
        due = 0.0
        for (prompt, _), gap, result in zip(requests, gaps, results):
            due += gap / rate
            delay = t0 + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_one(client, url, model, result, prompt, timeout)))
        await asyncio.gather(*tasks)
    ends = [r.send_time + r.e2e for r in results if r.e2e is not None]
    duration = (max(ends) if ends else time.perf_counter()) - t0
    return results, duration


# ---------------------------------------------------------------------------- statistics
def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


PCTS = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2e")


def summarize(rate: float, results: list[Result], duration: float, other_load: float | None) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    out_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "rate": rate,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error}),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_token_throughput": out_tokens / duration if duration > 0 else None,
        "prompt_tokens": sum(r.prompt_len for r in ok),
        "output_tokens": out_tokens,
        "other_load_cores": other_load,
    }
    for m in METRICS:
        for p in PCTS:
            summary[f"{m}_p{p}_s"] = percentile(values[m], p)
        summary[f"{m}_mean_s"] = sum(values[m]) / len(values[m]) if values[m] else None
    return summary


def table(summaries: list[dict[str, Any]]) -> str:
    headers = ["rate", "ok", "req/s", "out tok/s"]
    for m in METRICS:
        headers += [f"{m.upper()} p{p}" for p in PCTS]
    headers += ["server cores", "other load"]
    rows = []
    for s in summaries:
        row: list[Any] = [s["rate"], f"{s['completed']}/{s['num_requests']}", s["request_throughput"], s["output_token_throughput"]]
        for m in METRICS:
            scale = 1.0 if m == "e2e" else 1000.0
            row += [None if s[f"{m}_p{p}_s"] is None else s[f"{m}_p{p}_s"] * scale for p in PCTS]
        row += [s.get("server_cpu_cores"), s["other_load_cores"]]
        rows.append(row)
    return format_table(headers, rows) + "\n(TTFT, TPOT, ITL in ms; E2E in s; server cores and other load in CPU cores)"


def plot(summaries: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [s["rate"] for s in summaries]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    names = {"ttft": "TTFT (ms)", "tpot": "TPOT (ms)", "itl": "ITL (ms)", "e2e": "E2E latency (s)"}
    for ax, m in zip(axes.flat, METRICS):
        scale = 1.0 if m == "e2e" else 1000.0
        for p, style in zip(PCTS, ("o-", "s--", "^:")):
            ys = [None if s[f"{m}_p{p}_s"] is None else s[f"{m}_p{p}_s"] * scale for s in summaries]
            ax.plot(rates, [float("nan") if y is None else y for y in ys], style, label=f"p{p}")
        ax.set_title(names[m])
        ax.grid(True, alpha=0.3)
        ax.legend()
    for ax in axes[1]:
        ax.set_xlabel("request rate (req/s)")
    throughput = ", ".join(f"{s['rate']:g}: {s['output_token_throughput'] or 0:.0f}" for s in summaries)
    fig.suptitle(f"{title}\noutput tok/s by rate: {throughput}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvflow.model.resolve import load_tokenizer, resolve_model

    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    requests = make_requests(tokenizer, args)
    gaps = arrival_gaps(len(requests), args.seed)

    proc = log = None
    url = args.base_url.rstrip("/") if args.base_url else None
    out = Path(args.out)
    try:
        if url is None:
            log_path = Path(tempfile.mkdtemp(prefix="kvflow-serving-")) / "server.log"
            proc, url, log = start_server(args, log_path)
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        # warm-up: one short request, not measured
        warm = httpx.post(url + "/v1/completions", json={"model": model, "prompt": requests[0][0][:32], "max_tokens": 4},
                          timeout=args.request_timeout)  # fmt: skip
        warm.raise_for_status()
        busy_before = cpu_busy_fraction(1.0)
        summaries, per_request = [], {}
        for rate in args.rates:
            wait_server_idle(url)
            print(f"rate {rate:g} req/s: {len(requests)} requests ...", file=sys.stderr, flush=True)
            server_cpu = process_cpu_seconds(proc.pid) if proc is not None else None
            t = time.perf_counter()
            with OtherLoad() as load:
                results, duration = asyncio.run(run_rate(url, model, requests, gaps, rate, args.request_timeout))
            wall = time.perf_counter() - t
            other = load.cores
            server_cores = None
            if server_cpu is not None and (server_cpu_end := process_cpu_seconds(proc.pid)) is not None:
                server_cores = (server_cpu_end - server_cpu) / wall
                other = None if other is None else max(0.0, other - server_cores)
            summary = summarize(rate, results, duration, other)
            summary["server_cpu_cores"] = server_cores
            summaries.append(summary)
            per_request[str(rate)] = [{**asdict(r), "tpot": r.tpot} for r in results]
    finally:
        if proc is not None:
            stop_server(proc, log)

    title = f"kvflow serve, {Path(str(model_dir)).name}, {args.num_requests} requests/rate"
    print(table(summaries))
    record = {
        "benchmark": "serving",
        "config": {k: v for k, v in vars(args).items()},
        "server": "external" if args.base_url else "started",
        "model_dir": str(model_dir),
        "machine": {**machine_info(), "cpu_busy_before": busy_before, "pid": os.getpid()},
        "summaries": summaries,
        "requests": per_request,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    if args.plot:
        plot(summaries, Path(args.plot), title)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
