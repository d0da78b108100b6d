"""Prefix sharing: the same shared-system-prompt workload with prefix caching on and off.

What it measures
----------------
N requests (default 64) whose prompts are one shared system prompt (the first
``--system-tokens`` tokens of ``/usr/share/common-licenses/GPL-3``, default 512, tokenized
with the model's tokenizer) followed by a distinct question: consecutive, non-overlapping
windows of the same text after the system prompt, lengths uniform in 16-48 tokens (fixed
seed). Greedy, ``--max-tokens`` (default 32) tokens each with EOS ignored. All requests are
queued at once and the engine is driven step by step (``LLMEngine.add_request`` /
``LLMEngine.step``) so that it can be sampled after every step.

The workload runs twice in one process over the same loaded float32 weights and the same
number of KV blocks: the ``LLM`` engine with ``enable_prefix_caching=True``, then a second
``LLMEngine`` built from the first one's model with ``enable_prefix_caching=False`` (as
``tests/entrypoints/test_llm.py::_engine_like`` does). Each engine runs one short unrelated
warm-up request first (Apache-2.0 text); counters are taken as differences around the run.

Per run:

* **peak KV blocks**: the most blocks referenced by requests
  (``num_total_blocks - num_free_blocks``; free cached blocks count as free), sampled right
  after each ``schedule()`` (the step's peak: blocks are allocated there) and after each step;
* **prefill tokens computed**: summed over the scheduler outputs (scheduled tokens minus
  decode tokens, a decode being 1 token for a request whose only uncomputed token is its
  last sampled one), cross-checked against prompt tokens minus ``prefix_cache_hits``
  (equal when nothing is preempted);
* **prefix cache hit rate**: ``prefix_cache_hits / prefix_cache_queries`` (tokens);
* **wall time and output tok/s** of the step loop;
* **fragmentation**: the mean over steps of ``get_stats()["fragmentation"]`` (allocated
  slots not holding a token / allocated slots, shared blocks counted once), against a
  contiguous baseline in which each running request reserves its slots up front and
  wastes ``reserved - used``: reserving ``max_model_len`` slots, or reserving
  ``prompt + max_tokens`` slots (sampled at the same steps, over the same running requests);
* greedy outputs of the two runs are compared token for token (they must be equal).

Targets reported against: fragmentation < 2 %; with sharing at least 50 % fewer peak blocks
and 50 % fewer prefill tokens than without.

How to run
----------
    python -m benchmarks.prefix_sharing                        # 64 requests, 512-token system prompt
    python -m benchmarks.prefix_sharing --num-requests 16      # a quicker run

Prints a table and writes every number to ``--out`` (default
``benchmarks/results/prefix_sharing.json``; not tracked by git).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import TEXT_FILES, format_table, machine_info, tokenize_corpus

TARGET_FRAGMENTATION = 0.02
TARGET_REDUCTION = 0.50


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_sharing", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="kvflow model name or path (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=64, help="requests (default: %(default)s)")
    p.add_argument("--system-tokens", type=int, default=512, help="shared system prompt length, tokens (default: %(default)s)")
    p.add_argument("--min-question-tokens", type=int, default=16)
    p.add_argument("--max-question-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="question-length seed (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine max_num_seqs (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget (default: %(default)s)")
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks of both engines (default: enough for every request at once without sharing, "
        "so neither run waits for memory or preempts and peak blocks show demand, not capacity)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--out", default="benchmarks/results/prefix_sharing.json", help="JSON output (default: %(default)s)")
    args = p.parse_args(argv)
    for name in ("num_requests", "system_tokens", "max_tokens", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 1 <= args.min_question_tokens <= args.max_question_tokens:
        p.error("question lengths must satisfy 1 <= min <= max")
    return args


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------- workload
def make_prompts(tokenizer: Any, args: argparse.Namespace) -> tuple[list[int], list[list[int]], list[int]]:
    """(system prompt ids, one prompt per request = system + question, question offsets).

    Questions are consecutive non-overlapping GPL-3 windows after the system prompt, so no two
    share a token window (and hence no full question block).

    Raises:
        ValueError: when GPL-3 is too short for the asked lengths.
    """
    gpl = next(path for path in TEXT_FILES if path.name == "GPL-3")
    ids = tokenize_corpus(tokenizer, (gpl,))[gpl.name]
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_question_tokens, args.max_question_tokens) for _ in range(args.num_requests)]
    if args.system_tokens + sum(lengths) > len(ids):
        raise ValueError(
            f"GPL-3 has {len(ids)} tokens; {args.system_tokens} system + {sum(lengths)} question tokens do not fit"
        )
    system = ids[: args.system_tokens]
    prompts, offsets, pos = [], [], args.system_tokens
    for n in lengths:
        prompts.append(system + ids[pos : pos + n])
        offsets.append(pos)
        pos += n
    return system, prompts, offsets


# ---------------------------------------------------------------------------------- one run
def _counters(engine: Any) -> dict[str, int]:
    s = engine.get_stats()
    return {k: int(s[k]) for k in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")}


def warm_up(engine: Any, tokenizer: Any) -> None:
    """One short unrelated request (Apache-2.0 text), to leave one-time costs out of the timing."""
    from kvflow import SamplingParams

    apache = next(path for path in TEXT_FILES if path.name == "Apache-2.0")
    ids = tokenize_corpus(tokenizer, (apache,))[apache.name][:64]
    engine.add_request("warmup", ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run(engine: Any, prompts: list[list[int]], max_tokens: int, max_model_len: int) -> dict[str, Any]:
    """Queue every prompt, step until done, sampling the cache after every schedule and step."""
    from kvflow import SamplingParams

    kv = engine.kv_cache_manager
    bs = kv.block_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = _counters(engine)

    tally = {"prefill": 0, "decode": 0, "scheduled": 0}
    cached_at_admission: dict[str, int] = {}
    in_use_after_schedule: list[int] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():  # an instance attribute shadows the method; removed below
        out = schedule()
        for r in map(engine.scheduler.requests.get, out.scheduled_req_ids):
            n = out.num_scheduled_tokens[r.request_id]
            decode = n == 1 and r.num_output_tokens > 0 and r.num_computed_tokens == r.num_tokens - 1
            tally["decode" if decode else "prefill"] += n
            tally["scheduled"] += n
            cached_at_admission.setdefault(r.request_id, r.num_computed_tokens)
        in_use_after_schedule.append(kv.num_total_blocks - kv.num_free_blocks)
        return out

    in_use_after_step: list[int] = []
    fragmentation: list[float] = []
    contiguous_max_len: list[float] = []
    contiguous_exact: list[float] = []
    wasted_slots: list[float] = []
    running_counts: list[int] = []
    reserved_max_len_slots: list[int] = []
    step_s: list[float] = []

    tokens: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    engine.scheduler.schedule = recording_schedule
    try:
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            t_step = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            step_s.append(time.perf_counter() - t_step)
            stats = engine.get_stats()
            in_use_after_step.append(stats["num_total_blocks"] - stats["num_free_blocks"])
            running = [r for r in engine.scheduler.running if r.block_ids]
            if not running:
                continue  # the last step: everything finished and was freed
            fragmentation.append(float(stats["fragmentation"]))
            wasted_slots.append(float(stats["fragmentation"]) * in_use_after_step[-1] * bs)
            used = sum(r.num_computed_tokens for r in running)
            reserve_max = len(running) * max_model_len
            reserve_exact = sum(min(r.num_prompt_tokens + max_tokens, max_model_len) for r in running)
            contiguous_max_len.append((reserve_max - used) / reserve_max)
            contiguous_exact.append((reserve_exact - used) / reserve_exact)
            running_counts.append(len(running))
            reserved_max_len_slots.append(reserve_max)
        wall = time.perf_counter() - t0
    finally:
        del engine.scheduler.schedule

    after = _counters(engine)
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(t) for t in tokens.values())
    if output_tokens != len(prompts) * max_tokens:
        raise RuntimeError(f"{output_tokens} output tokens, expected {len(prompts) * max_tokens}")
    stats = engine.get_stats()
    if stats["num_free_blocks"] != stats["num_total_blocks"]:
        raise RuntimeError(f"blocks leaked: {stats['num_free_blocks']} free of {stats['num_total_blocks']}")
    peak = max(in_use_after_schedule + in_use_after_step)
    return {
        "num_requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "num_steps": len(in_use_after_step),
        "wall_s": wall,
        "output_tokens_per_s": output_tokens / wall,
        "peak_blocks": peak,
        "peak_blocks_after_step": max(in_use_after_step),
        "peak_kv_bytes": peak * engine.model_config.kv_bytes_per_token(engine.cache_config.dtype) * bs,
        "prefill_tokens_computed": tally["prefill"],
        "prefill_tokens_prompt_minus_hits": prompt_tokens - hits,
        "decode_tokens": tally["decode"],
        "scheduled_tokens": tally["scheduled"],
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "requests_without_hit": sum(1 for n in cached_at_admission.values() if n == 0),
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        "fragmentation_mean": statistics.fmean(fragmentation),
        "fragmentation_max": max(fragmentation),
        "wasted_slots_mean": statistics.fmean(wasted_slots),
        "contiguous_max_len_waste_mean": statistics.fmean(contiguous_max_len),
        "contiguous_prompt_plus_max_tokens_waste_mean": statistics.fmean(contiguous_exact),
        "contiguous_max_len_peak_blocks": max(reserved_max_len_slots) // bs,
        "max_running": max(running_counts),
        "blocks_in_use_per_step": in_use_after_schedule,
        "step_s": step_s,
        "_tokens": tokens,
    }


# ---------------------------------------------------------------------------------- main
def _reduction(with_sharing: float, without: float) -> float:
    return 1.0 - with_sharing / without if without else 0.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from kvflow import LLM
    from kvflow.engine.llm_engine import LLMEngine

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t_load = time.perf_counter()
    num_blocks = args.num_kv_blocks
    if num_blocks is None:
        per_request = _cdiv(args.system_tokens + args.max_question_tokens + args.max_tokens, args.block_size)
        num_blocks = args.num_requests * per_request
    llm = LLM(
        model=args.model,
        dtype="float32",
        block_size=args.block_size,
        num_kv_blocks=num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=True,
        seed=0,
    )
    load_s = time.perf_counter() - t_load
    shared = llm.engine
    tokenizer = llm.tokenizer
    system, prompts, offsets = make_prompts(tokenizer, args)
    max_model_len = shared.scheduler_config.max_model_len
    print(
        f"{args.num_requests} requests: {len(system)}-token shared system prompt + "
        f"{args.min_question_tokens}-{args.max_question_tokens}-token questions, {args.max_tokens} output tokens each; "
        f"{num_blocks} KV blocks of {args.block_size} tokens per engine; torch threads {torch.get_num_threads()}",
        file=sys.stderr,
    )

    warm_up(shared, tokenizer)
    on = run(shared, prompts, args.max_tokens, max_model_len)
    print(f"prefix caching on: {on['wall_s']:.1f} s", file=sys.stderr)

    unshared = LLMEngine(
        dataclasses.replace(shared.config, cache=dataclasses.replace(shared.cache_config, enable_prefix_caching=False)),
        model=shared.model_runner.model,
        tokenizer=shared.tokenizer,
    )
    warm_up(unshared, tokenizer)
    off = run(unshared, prompts, args.max_tokens, max_model_len)
    print(f"prefix caching off: {off['wall_s']:.1f} s", file=sys.stderr)

    tokens_on, tokens_off = on.pop("_tokens"), off.pop("_tokens")
    mismatches = sorted((k for k in tokens_on if tokens_on[k] != tokens_off.get(k)), key=int)

    block_reduction = _reduction(on["peak_blocks"], off["peak_blocks"])
    prefill_reduction = _reduction(on["prefill_tokens_computed"], off["prefill_tokens_computed"])
    targets = {
        "fragmentation_below_2pct_sharing_on": on["fragmentation_mean"] < TARGET_FRAGMENTATION,
        "fragmentation_below_2pct_sharing_off": off["fragmentation_mean"] < TARGET_FRAGMENTATION,
        "peak_blocks_reduction_at_least_50pct": block_reduction >= TARGET_REDUCTION,
        "prefill_tokens_reduction_at_least_50pct": prefill_reduction >= TARGET_REDUCTION,
    }

    def pct(x: float) -> str:
        return f"{100 * x:.2f}%"

    def row(name: str, r: dict[str, Any]) -> list[Any]:
        return [
            name,
            r["peak_blocks"],
            r["prefill_tokens_computed"],
            r["prefill_tokens_prompt_minus_hits"],
            pct(r["prefix_cache_hit_rate"]),
            r["requests_without_hit"],
            pct(r["fragmentation_mean"]),
            r["wasted_slots_mean"],
            pct(r["contiguous_prompt_plus_max_tokens_waste_mean"]),
            pct(r["contiguous_max_len_waste_mean"]),
            r["num_steps"],
            r["num_preemptions"],
            r["wall_s"],
            r["output_tokens_per_s"],
        ]

    headers = [
        "prefix caching", "peak blocks", "prefill tok", "prompt-hits", "hit rate", "cold reqs",
        "frag (paged)", "idle slots", "waste p+max", f"waste {max_model_len}", "steps", "preempt", "wall s", "out tok/s",
    ]
    table = format_table(headers, [row("on", on), row("off", off)])
    lines = [
        table,
        "",
        f"peak blocks: {on['peak_blocks']} vs {off['peak_blocks']} -> {pct(block_reduction)} fewer "
        f"(target >= 50%: {'met' if targets['peak_blocks_reduction_at_least_50pct'] else 'NOT met'}); "
        f"contiguous max_model_len reservation would need {off['contiguous_max_len_peak_blocks']} blocks",
        f"prefill tokens: {on['prefill_tokens_computed']} vs {off['prefill_tokens_computed']} -> "
        f"{pct(prefill_reduction)} fewer (target >= 50%: "
        f"{'met' if targets['prefill_tokens_reduction_at_least_50pct'] else 'NOT met'})",
        f"fragmentation (mean over steps, target < 2%): on {pct(on['fragmentation_mean'])} "
        f"({'met' if targets['fragmentation_below_2pct_sharing_on'] else 'NOT met'}), "
        f"off {pct(off['fragmentation_mean'])} "
        f"({'met' if targets['fragmentation_below_2pct_sharing_off'] else 'NOT met'}); idle slots (tokens) "
        f"{on['wasted_slots_mean']:.0f} on vs {off['wasted_slots_mean']:.0f} off; contiguous baselines: "
        f"reserve prompt+max_tokens {pct(off['contiguous_prompt_plus_max_tokens_waste_mean'])}, "
        f"reserve max_model_len={max_model_len} {pct(off['contiguous_max_len_waste_mean'])}",
        f"greedy outputs identical on/off: {'yes' if not mismatches else f'NO ({len(mismatches)} differ: {mismatches[:8]})'}",
    ]
    print("\n".join(lines))

    record = {
        "benchmark": "prefix_sharing",
        "config": {**vars(args), "num_kv_blocks": num_blocks, "max_model_len": max_model_len, "dtype": "float32"},
        "machine": machine_info(),
        "model_load_s": load_s,
        "workload": {
            "system_prompt_tokens": len(system),
            "question_offsets": offsets,
            "prompt_lens": [len(p) for p in prompts],
            "prompt_tokens": sum(len(p) for p in prompts),
        },
        "results": {"prefix_caching_on": on, "prefix_caching_off": off},
        "peak_blocks_reduction": block_reduction,
        "prefill_tokens_reduction": prefill_reduction,
        "targets": targets,
        "outputs_identical": not mismatches,
        "mismatched_requests": mismatches,
        "table": table,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
