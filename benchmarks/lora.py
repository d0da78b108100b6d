"""Multi-LoRA serving: throughput of a batch mixing 4 adapters vs the base model alone, and the
memory each extra adapter takes.

What it measures
----------------
One engine (``LLM(model, enable_lora=True, max_loras=4, max_lora_rank=--rank)``, prefix
caching off) and ``--num-adapters`` (4) random PEFT adapters written here for the model
(rank ``--rank``, every q/k/v/o/gate/up/down projection of every layer, A and B N(0, 0.02),
``lora_alpha = 2 r``). The workload is ``--num-requests`` (32) requests, all queued at once,
each a prompt of ``--prompt-tokens`` (64) random token ids (fixed seed) and ``--max-tokens``
(32) greedy tokens with EOS ignored, run twice over the same engine:

* **base**: no request has an adapter (the forward takes the base path: no LoRA mapping);
* **mixed**: request i runs with adapter i mod 4, so every step mixes the 4 adapters.

Each is run ``--repeats`` (2) times alternately after one warm-up of each; the best wall
time counts (the machine is shared). Throughput is output tokens / wall time of
``LLM.generate``. Target: mixed >= 0.8 x base.

Memory per extra adapter: the slot table's bytes per slot (A and B of every targeted layer at
``max_lora_rank``, ``LoRAManager.nbytes_per_slot``; allocated once for ``max_loras`` slots)
and the host copy of one adapter (``LoRAModel.nbytes``, in the CPU-side cache), also as a
share of the model's weight bytes.

How to run
----------
    python -m benchmarks.lora                                   # SmolLM2-135M, 32 requests
    python -m benchmarks.lora --num-requests 16 --max-tokens 16  # quicker

Prints a table and writes every number to ``--out`` (default ``benchmarks/results/lora.json``;
not tracked by git).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import format_table, machine_info

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="model (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="model dtype (default: %(default)s)")
    p.add_argument("--num-adapters", type=int, default=4, help="adapters mixed (default: %(default)s)")
    p.add_argument("--rank", type=int, default=8, help="adapter rank r (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=32, help="concurrent requests (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each workload (default: %(default)s)")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--out", default="benchmarks/results/lora.json", help="JSON output (default: %(default)s)")
    args = p.parse_args(argv)
    for name in ("num_adapters", "rank", "num_requests", "prompt_tokens", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def write_adapter(path: Path, config: Any, rank: int, seed: int) -> None:
    """A PEFT LoRA folder for a Llama-shaped ``config`` (kvflow ``ModelConfig``): every
    projection of every layer, A [r, in] and B [out, r] N(0, 0.02)."""
    from safetensors.torch import save_file

    h, d = config.hidden_size, config.head_dim
    shapes = {"q_proj": (h, config.num_attention_heads * d), "k_proj": (h, config.num_key_value_heads * d),
              "v_proj": (h, config.num_key_value_heads * d), "o_proj": (config.num_attention_heads * d, h),
              "gate_proj": (h, config.intermediate_size), "up_proj": (h, config.intermediate_size),
              "down_proj": (config.intermediate_size, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (n_in, n_out) in shapes.items():
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = 0.02 * torch.randn(rank, n_in, generator=g)
            tensors[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(n_out, rank, generator=g)
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def timed(llm: Any, prompts: list[list[int]], params: Any, loras: list[Any] | None) -> tuple[float, int]:
    """(wall seconds, output tokens) of one ``generate`` of the whole batch."""
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvflow import LLM, LoRARequest, SamplingParams

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    llm = LLM(args.model, dtype=args.dtype, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank,
              max_num_seqs=max(args.num_requests, 1), enable_prefix_caching=False, num_threads=args.num_threads)
    engine = llm.engine
    config = engine.model_config
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(args.prompt_tokens)] for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        loras = []
        for i in range(args.num_adapters):
            write_adapter(Path(tmp) / f"a{i}", config, args.rank, seed=i)
            loras.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        mixed = [loras[i % len(loras)] for i in range(args.num_requests)]
        timed(llm, prompts[:4], params, None)  # warm-up of both paths (and the adapters' loading)
        timed(llm, prompts[:4], params, mixed[:4])
        runs: dict[str, list[float]] = {"base": [], "mixed": []}
        tokens = {}
        for _ in range(args.repeats):
            for name, choice in (("base", None), ("mixed", mixed)):
                wall, n = timed(llm, prompts, params, choice)
                runs[name].append(wall)
                tokens[name] = n
        manager = engine.lora_manager
        host_bytes = [manager.get(lora).nbytes for lora in loras]
    # (state_dict: dense weights, also of the layers prepacked for oneDNN)
    weight_bytes = sum(t.nelement() * t.element_size() for t in engine.model_runner.model.state_dict().values())
    best = {name: min(walls) for name, walls in runs.items()}
    tps = {name: tokens[name] / best[name] for name in best}
    ratio = tps["mixed"] / tps["base"]
    result = {
        "args": vars(args), "machine": machine_info(), "model_weight_bytes": weight_bytes,
        "dtype": str(next(engine.model_runner.model.parameters()).dtype),
        "wall_s": runs, "output_tokens": tokens, "output_tok_per_s": tps, "mixed_over_base": ratio,
        "target_mixed_over_base": 0.8, "meets_target": ratio >= 0.8,
        "slot_bytes_per_adapter": manager.nbytes_per_slot, "host_bytes_per_adapter": host_bytes[0],
        "slot_table_bytes": manager.nbytes_per_slot * manager.max_loras,
    }
    print(format_table(["workload", "requests", "output tokens", "best wall s", "output tok/s"],
                       [[name, args.num_requests, tokens[name], f"{best[name]:.2f}", f"{tps[name]:.1f}"]
                        for name in ("base", "mixed")]))
    print(f"mixed / base throughput: {ratio:.2f} (target >= 0.8)")
    print(f"memory per extra adapter (rank {args.rank}, all projections): slot {manager.nbytes_per_slot / 2**20:.2f} MiB "
          f"+ host copy {host_bytes[0] / 2**20:.2f} MiB ({100 * manager.nbytes_per_slot / weight_bytes:.1f} % of the "
          f"{weight_bytes / 2**20:.0f} MiB of weights per slot)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
