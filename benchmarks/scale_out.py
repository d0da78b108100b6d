"""Replicas behind a cache-aware router: prefix-cache hit rate and TTFT against round-robin
and against one replica, on a multi-tenant workload.

What it measures
----------------
The workload: 8 tenants, each with its own system prompt of 512 tokens (windows of
``/usr/share/common-licenses/GPL-3``), 8 requests each (the system prompt, then a short
question of its own), 64 requests in a seeded random interleaving, sent as streaming
``/v1/completions`` (text prompts, so that the router sees the text it routes on), greedy,
``--max-tokens`` tokens each, ``--concurrency`` at a time.

Three set-ups with the same CPUs and the same KV memory in total:

* ``cache_aware``: two replicas (``kvflow serve``, one thread each, pinned to one core
  each, ``--num-kv-blocks`` blocks each) behind ``vllm-router --policy cache_aware``;
* ``round_robin``: the same two replicas behind ``vllm-router --policy round_robin``;
* ``single``: one replica with two threads and twice the blocks;
* ``ray_serve`` (with ``--ray``, after the others have stopped): two replicas as Ray Serve
  deployments (``kvflow.entrypoints.ray_serve``, one thread and one Ray CPU each, the same
  blocks each) behind Ray's ``PrefixCacheAffinityRouter``, on a local Ray cluster.

The per-replica KV budget holds about 5 of the 8 system prompts: a policy that sends every
tenant to both replicas (round-robin over a random interleaving) makes each replica cycle
through all 8 and evict, one that keeps each tenant on one replica does not. Between
set-ups every replica's prefix cache is flushed (``POST /flush_cache``).

Per set-up: the prefix-cache hit rate (the increase of ``kvflow:prefix_cache_hits_total``
over that of ``kvflow:prefix_cache_queries_total``, summed over the replicas' ``/metrics``),
the cached prompt tokens the responses report (``usage.prompt_tokens_details``), the mean
and p50 / p90 TTFT (request sent -> first chunk with text) and the duration; plus the
requests each replica served. Ray Serve's replicas have no URL of their own, so their hit
rate is the responses' cached prompt tokens over their prompt tokens (on the other set-ups
the two agree to the token).

How to run
----------
    python -m benchmarks.scale_out                    # the issue's workload, ~5-10 min on 2 loaded cores
    python -m benchmarks.scale_out --num-requests 16  # a quick run
    python -m benchmarks.scale_out --ray              # also the Ray Serve set-up (needs ray[serve])

Needs ``vllm-router`` (``pip install 'kvflow[scale-out]'``). Prints a table and writes JSON
to ``--out`` (default ``benchmarks/results/scale_out.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import format_table, machine_info
from kvflow.entrypoints.data_parallel import (DataParallelServer, _child_setup, free_port, http_ok, replica_argv,
                                              router_argv)

GPL = Path("/usr/share/common-licenses/GPL-3")


def tenant_prompts(tokenizer, num_tenants: int, tokens: int) -> list[str]:
    """``num_tenants`` system prompts of about ``tokens`` tokens: disjoint windows of GPL-3."""
    ids = tokenizer(GPL.read_text())["input_ids"]
    if len(ids) < num_tenants * tokens:
        raise ValueError(f"GPL-3 has {len(ids)} tokens, fewer than {num_tenants} x {tokens}")
    return [f"[tenant {t}] " + tokenizer.decode(ids[t * tokens:(t + 1) * tokens]) for t in range(num_tenants)]


def workload(prompts: list[str], num_requests: int, seed: int) -> list[tuple[int, str]]:
    """(tenant, prompt) pairs: each tenant's system prompt and a question, seeded order."""
    per = num_requests // len(prompts)
    items = [(t, f"{prompts[t]}\n\nQuestion {q} of tenant {t}: what does section {q + 1} say?\nAnswer:")
             for t in range(len(prompts)) for q in range(per)]
    random.Random(seed).shuffle(items)
    return items


def counters(url: str) -> tuple[float, float]:
    """(prefix_cache_hits, prefix_cache_queries) of one server's /metrics (tokens)."""
    text = httpx.get(url + "/metrics", timeout=30).text

    def value(name: str) -> float:
        return sum(float(m) for m in re.findall(rf"^kvflow:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))

    return value("prefix_cache_hits"), value("prefix_cache_queries")


def one_request(base: str, model: str, prompt: str, max_tokens: int, timeout: float) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    ttft, usage = None, None
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {r.read()[:200]!r}"}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if ttft is None and any(c.get("text") for c in event.get("choices", [])):
                    ttft = time.perf_counter() - start
                if event.get("usage"):
                    usage = event["usage"]
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - start, "usage": usage}


def run_setup(name: str, base: str, replica_urls: list[str], model: str, items, args) -> dict[str, Any]:
    for url in replica_urls:
        r = httpx.post(url + "/flush_cache", timeout=60)
        assert r.status_code == 200, (url, r.text)
    before = [counters(u) for u in replica_urls]
    served_before = [_served(u) for u in replica_urls]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda it: one_request(base, model, it[1], args.max_tokens, args.request_timeout),
                                items))
    duration = time.perf_counter() - start
    after = [counters(u) for u in replica_urls]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    ok = [r for r in results if "error" not in r and r["ttft_s"] is not None]
    if not replica_urls:  # replicas without URLs of their own (Ray Serve): from the responses' usage
        hits = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok if r["usage"])
        queries = sum(r["usage"]["prompt_tokens"] for r in ok if r["usage"])
    ttfts = sorted(r["ttft_s"] for r in ok)

    def pct(p: float) -> float | None:
        return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else None

    return {
        "setup": name, "requests": len(items), "failed": len(items) - len(ok),
        "errors": [r["error"] for r in results if "error" in r][:5],
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "prefix_cache_hits": hits, "prefix_cache_queries": queries,
        "usage_cached_tokens": sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok if r["usage"]),
        "usage_prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in ok if r["usage"]),
        "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None, "p50_ttft_s": pct(0.5), "p90_ttft_s": pct(0.9),
        "duration_s": duration,
        "requests_per_replica": [_served(u) - b for u, b in zip(replica_urls, served_before)],
    }


def run_ray_setup(args, items, cpus: list[int]) -> tuple[dict[str, Any], float]:
    """The workload through two Ray Serve replicas on a local cluster: (its row, start-up s)."""
    import ray
    from ray import serve

    from kvflow.entrypoints.ray_serve import build_openai_app

    port = free_port()
    t0 = time.perf_counter()
    ray.init(num_cpus=len(cpus), include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = {"model": args.model, "num_threads": 1, "block_size": 16, "num_kv_blocks": args.num_kv_blocks,
                  "max_num_seqs": 8}
        serve.run(build_openai_app(engine, num_replicas=2, num_cpus_per_replica=1), route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        model = httpx.get(base + "/v1/models", timeout=60).json()["data"][0]["id"]
        startup_s = time.perf_counter() - t0
        row = run_setup("ray_serve", base, [], model, items, args)
    finally:
        serve.shutdown()
        ray.shutdown()
    return row, startup_s


def _served(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(m) for m in re.findall(r"^kvflow:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-tenants", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-kv-blocks", type=int, default=176, help="per replica (block size 16); the single one gets 2x")
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ray", action="store_true", help="also run the workload on two Ray Serve replicas")
    p.add_argument("--out", default="benchmarks/results/scale_out.json")
    args = p.parse_args(argv)
    load_before = os.getloadavg()

    from kvflow.model.resolve import resolve_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    items = workload(tenant_prompts(tokenizer, args.num_tenants, args.system_tokens), args.num_requests, args.seed)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    common = ["serve", args.model, "--block-size", "16", "--log-level", "warning", "--max-num-seqs", "8"]
    dp = DataParallelServer([*common, "--num-kv-blocks", str(args.num_kv_blocks)], 2, port=free_port(),
                            policy="cache_aware", num_threads=1, cpus=cpus, restart=False)
    single_port = free_port()
    single_argv = [sys.executable, "-m", "kvflow.entrypoints.cli",
                   *replica_argv([*common, "--num-kv-blocks", str(2 * args.num_kv_blocks)], single_port, len(cpus))]
    single = subprocess.Popen(single_argv, preexec_fn=_child_setup(cpus), stdin=subprocess.DEVNULL)
    rr = None
    t0 = time.perf_counter()
    try:
        dp.start()
        rr_port = free_port()
        rr = subprocess.Popen(router_argv("vllm-router", "127.0.0.1", rr_port, [r.url for r in dp.replicas],
                                          "round_robin", free_port()), preexec_fn=_child_setup(None),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        single_url = f"http://127.0.0.1:{single_port}"
        deadline = time.monotonic() + 600
        while not (http_ok(single_url + "/health") and http_ok(f"http://127.0.0.1:{rr_port}/health")):
            assert time.monotonic() < deadline and single.poll() is None and rr.poll() is None, "start-up failed"
            time.sleep(0.5)
        startup_s = time.perf_counter() - t0
        replica_urls = [r.url for r in dp.replicas]
        model = args.model
        rows = [
            run_setup("cache_aware", dp.url, replica_urls, model, items, args),
            run_setup("round_robin", f"http://127.0.0.1:{rr_port}", replica_urls, model, items, args),
            run_setup("single", single_url, [single_url], model, items, args),
        ]
    finally:
        for proc in (rr, single):
            if proc is not None:
                proc.terminate()
        dp.stop()
        for proc in (rr, single):
            if proc is not None:
                proc.wait(30)
    ray_startup_s = None
    if args.ray:
        row, ray_startup_s = run_ray_setup(args, items, cpus)
        rows.append(row)
    by = {r["setup"]: r for r in rows}
    ca, rrr, one = by["cache_aware"], by["round_robin"], by["single"]
    checks = {
        "hit_rate_vs_single": ca["prefix_cache_hit_rate"] / one["prefix_cache_hit_rate"],
        "hit_rate_vs_round_robin": ca["prefix_cache_hit_rate"] / rrr["prefix_cache_hit_rate"],
        "mean_ttft_vs_round_robin": ca["mean_ttft_s"] / rrr["mean_ttft_s"],
    }
    headers = ["setup", "hit rate", "cached tok (usage)", "mean TTFT s", "p50 TTFT s", "p90 TTFT s", "duration s",
               "per replica", "failed"]
    table = format_table(headers, [[r["setup"], r["prefix_cache_hit_rate"], r["usage_cached_tokens"], r["mean_ttft_s"],
                                    r["p50_ttft_s"], r["p90_ttft_s"], r["duration_s"],
                                    "/".join(str(int(x)) for x in r["requests_per_replica"]), r["failed"]]
                                   for r in rows])
    print(table)
    print(f"cache_aware / single hit rate {checks['hit_rate_vs_single']:.2f} (target >= 0.9); "
          f"cache_aware / round_robin hit rate {checks['hit_rate_vs_round_robin']:.2f} (target >= 1.5); "
          f"cache_aware / round_robin mean TTFT {checks['mean_ttft_vs_round_robin']:.2f} (target < 1)")
    if args.ray:
        ray_row = by["ray_serve"]
        checks["ray_hit_rate_vs_single"] = ray_row["prefix_cache_hit_rate"] / one["prefix_cache_hit_rate"]
        print(f"ray_serve / single hit rate {checks['ray_hit_rate_vs_single']:.2f}; ray_serve failed "
              f"{ray_row['failed']} of {ray_row['requests']}; Ray start-up + 2 replicas {ray_startup_s:.1f} s")
    record = {"machine": machine_info(), "args": vars(args), "startup_s": startup_s, "ray_startup_s": ray_startup_s,
              "results": rows, "ratios": checks, "load_average_before": load_before,
              "load_average_after": os.getloadavg()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
