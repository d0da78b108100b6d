"""Decode throughput of the GPU path: Triton attention + CUDA graphs vs eager vs PyTorch attention.

What it measures
----------------
The SmolLM2-135M architecture (30 layers, GQA 9:3, vocabulary 49152; ``SMOLLM2_135M``) with
random bfloat16 weights: speed does not depend on the weight values, and the real weights
(a 97 MB GGUF file) do not fit what travels to a device machine (64 MiB). Correctness is
the tests' job (``tests/attention/test_triton_attention.py``, ``tests/worker/``), which compare
the kernels and the graphs with the PyTorch path.

N requests (default 256) with random prompt token ids (lengths uniform in 64-512) and
output lengths uniform in 64-256, greedy, EOS ignored, all submitted at once to one
``LLMEngine``; only the stepping is timed, after a warm-up request. Configurations:

* ``triton+graphs``: Triton paged attention, decode steps replayed from CUDA graphs;
* ``triton-eager``: Triton paged attention, every kernel launched from Python;
* ``torch-eager``: gather + ``scaled_dot_product_attention`` per group of requests.

On a machine without CUDA it runs ``torch-eager`` only, on the CPU, as a smoke test (use a
small ``--num-prompts``).

How to run
----------
    python -m benchmarks.gpu_throughput --out $OUT/gpu_throughput.json
    bash benchmarks/gpu_check.sh     # the prepared device run: GPU tests, then this

It prints one table (output tokens/s, steps, mean ms per step, peak GPU memory) with
speedups over ``torch-eager`` in the same run and writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import format_table, machine_info
from kvflow.config import CacheConfig, ModelConfig, SchedulerConfig

SMOLLM2_135M = ModelConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
    mlp_bias=False, bos_token_id=1, eos_token_id=2,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--min-prompt-len", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--min-output-len", type=int, default=64)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=None, help="comma-separated subset of triton+graphs,triton-eager,torch-eager")
    p.add_argument("--out", default="benchmarks/results/gpu_throughput.json")
    return p.parse_args(argv)


def build_engine(config_name: str, args: argparse.Namespace, device: torch.device):
    from kvflow.config import DeviceConfig, EngineConfig, KernelConfig
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.model.llama import LlamaForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(SMOLLM2_135M)
            for p in model.parameters():
                p.data.normal_(0.0, 0.02)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    max_len = args.max_prompt_len + args.max_output_len
    per_request = -(-max_len // args.block_size)
    backend = "torch" if config_name == "torch-eager" else "triton"
    config = EngineConfig(
        model=SMOLLM2_135M,
        cache=CacheConfig(args.block_size, args.max_num_seqs * per_request, dtype, enable_prefix_caching=False),
        scheduler=SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, max_len),
        device=DeviceConfig(device, dtype),
        kernels=KernelConfig(backend, enforce_eager=config_name != "triton+graphs"),
        seed=args.seed,
    )
    return LLMEngine(config, model=model)


def workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [
        ([rng.randrange(3, SMOLLM2_135M.vocab_size) for _ in range(rng.randint(args.min_prompt_len, args.max_prompt_len))],
         rng.randint(args.min_output_len, args.max_output_len))
        for _ in range(args.num_prompts)
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(engine, requests: list[tuple[list[int], int]], device: torch.device) -> dict[str, Any]:
    from kvflow.sampling_params import SamplingParams

    engine.add_request("warmup", requests[0][0][:32], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    for i, (prompt, out_len) in enumerate(requests):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    steps = 0
    produced = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                produced[out.request_id] = len(out.outputs[0].token_ids)
        steps += 1
    _sync(device)
    elapsed = time.perf_counter() - t0
    expected = {str(i): n for i, (_, n) in enumerate(requests)}
    if produced != expected:
        raise RuntimeError("some request did not produce exactly its output length")
    output_tokens = sum(produced.values())
    return {
        "seconds": elapsed,
        "steps": steps,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / elapsed,
        "ms_per_step": elapsed / steps * 1e3,
        "peak_gpu_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = ["triton+graphs", "triton-eager", "torch-eager"] if device.type == "cuda" else ["torch-eager"]
    if args.configs:
        names = [n for n in args.configs.split(",") if n]
    requests = workload(args)
    results: dict[str, Any] = {}
    for name in names:
        print(f"[gpu_throughput] {name} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        engine = build_engine(name, args, device)
        setup_s = time.perf_counter() - t
        results[name] = {**run(engine, requests, device), "setup_s": setup_s}
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = results.get("torch-eager")
    rows = []
    for name, r in results.items():
        speedup = f"{r['output_tok_per_s'] / base['output_tok_per_s']:.2f}x" if base else "-"
        peak = f"{r['peak_gpu_mib']:.0f}" if r["peak_gpu_mib"] is not None else "-"
        rows.append([name, f"{r['output_tok_per_s']:.1f}", speedup, r["steps"], f"{r['ms_per_step']:.2f}",
                     f"{r['setup_s']:.1f}", peak])
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nSmolLM2-135M architecture, random {'bf16' if device.type == 'cuda' else 'fp32'} weights, {device_name}, "
          f"{args.num_prompts} requests, prompts {args.min_prompt_len}-{args.max_prompt_len}, outputs "
          f"{args.min_output_len}-{args.max_output_len}, max_num_seqs {args.max_num_seqs}")
    print(format_table(["config", "output tok/s", "vs torch-eager", "steps", "ms/step", "setup s", "peak GPU MiB"], rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "device": device_name, "machine": machine_info(),
                               "torch": torch.__version__, "results": results}, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
