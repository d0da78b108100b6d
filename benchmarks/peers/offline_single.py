"""Offline single-stream decode of a ``kvflow serve`` configuration: the reference that
``benchmarks/serve_peers.py --offline`` holds the served single stream against.

    python -m benchmarks.peers.offline_single --out /tmp/offline.json -- \\
        --model smollm2-135m --num-threads 2 --num-kv-blocks 1024

Everything after ``--`` is ``kvflow serve``'s command line without the subcommand: it is
parsed by kvflow's own CLI parser (``kvflow.entrypoints.cli.build_parser``), so the engine
gets exactly the ``EngineArgs`` the server gets (server-only flags such as ``--host`` are
parsed and ignored). The engine is built with ``LLM`` in this process, warmed up by one
stream, then ``--repeats`` streams run through ``LLM.generate_stream`` (no server, no event
loop, no HTTP): each a prompt of ``--prompt-len`` random token ids (a different one per run,
so none is a prefix-cache hit), ``--new-tokens`` greedy tokens with ``ignore_eos``. Per run:
TTFT (ms) and the decode rate, (n - 1) / (first -> last token) tokens/s, which is what
``vllm bench serve``'s TPOT measures on the served side (1000 / TPOT ms). The median run
is written to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m benchmarks.peers.offline_single [options] -- <kvflow serve flags>")
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.offline_single", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON result path")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=128, help="generated tokens per run (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is kept (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv[:split])
    if args.prompt_len < 1 or args.new_tokens < 2 or args.repeats < 1:
        p.error("need --prompt-len >= 1, --new-tokens >= 2 (the decode rate is timed from the first to the last "
                "token) and --repeats >= 1")
    return args, argv[split + 1:]


def engine_kwargs(serve_argv: list[str]) -> dict:
    """``LLM`` keyword arguments of a ``kvflow serve`` command line (without ``serve``)."""
    from kvflow.entrypoints.cli import _engine_kwargs, build_parser

    return _engine_kwargs(build_parser().parse_args(["serve", *serve_argv]))


def one_stream(llm, prompt_ids: list[int], new_tokens: int) -> dict[str, float]:
    """TTFT (ms) and decode tokens/s of one greedy stream through ``LLM.generate_stream``."""
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    stamps = [time.perf_counter() for _ in llm.generate_stream({"prompt_token_ids": prompt_ids}, params)]
    if len(stamps) != new_tokens:
        raise RuntimeError(f"the stream produced {len(stamps)} updates, expected {new_tokens}")
    return {"ttft_ms": 1000 * (stamps[0] - t0), "decode_tok_per_s": (new_tokens - 1) / (stamps[-1] - stamps[0])}


def main(argv: list[str] | None = None) -> int:
    args, serve_argv = parse_args(argv)
    from kvflow import LLM

    llm = LLM(**engine_kwargs(serve_argv))
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(args.prompt_len)]

    one_stream(llm, prompt(), args.new_tokens)  # warm-up
    runs = [one_stream(llm, prompt(), args.new_tokens) for _ in range(args.repeats)]
    median = statistics.median(r["decode_tok_per_s"] for r in runs)
    best = min(runs, key=lambda r: abs(r["decode_tok_per_s"] - median))
    result = {**best, "runs": runs, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"offline single stream: decode {best['decode_tok_per_s']:.1f} tok/s, TTFT {best['ttft_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
