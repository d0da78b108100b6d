"""What turning sampled tokens into outputs costs the engine per step, against a baseline tree.

What it measures
----------------
A tiny random model (2 layers, hidden 64, vocabulary 128: its forward is nearly free), so
that an engine step is mostly host work. ``--batch`` requests (8-token prompts, greedy,
``ignore_eos``, ``logprobs=1``) decode ``--max-tokens`` tokens each, all at once, driven by
``LLMEngine.step()`` the way ``LLM.generate`` drives it. The output side grows with a
request's length when every step copies a request's full token list and re-sums its
logprobs (O(n^2) over its life); with FINAL_ONLY / DELTA outputs and a running
``cumulative_logprob`` it does not. The same workload runs in a child process for this tree
and for ``--baseline`` (the root of an older checkout, e.g. one ``git worktree add``
made), alternating ``--repeats`` times, so a change of the machine's load hits both alike.
Reported per tree: the median wall time of the decode, steps/s, and the time of the last
quarter of the steps against the first quarter (1.0: no growth with length).

How to run
----------
    git worktree add /tmp/kvflow-base <old commit>
    python -m benchmarks.output_processing --baseline /tmp/kvflow-base
    python -m benchmarks.output_processing --baseline /tmp/kvflow-base --batch 32 --max-tokens 256

Prints a table and writes the numbers to ``--out`` (default
``benchmarks/results/output_processing.json``; not tracked by git).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, sys, time
import torch
torch.set_num_threads(1)
from kvflow.config import CacheConfig, DeviceConfig, EngineConfig, KernelConfig, ModelConfig, SchedulerConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.model.llama import LlamaForCausalLM
from kvflow.sampling_params import SamplingParams
batch, max_tokens = int(sys.argv[1]), int(sys.argv[2])
config = ModelConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                     rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096,
                     tie_word_embeddings=False, attention_bias=False, eos_token_id=None)
torch.manual_seed(0)
model = LlamaForCausalLM(config)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0.0, 0.2)
model.eval()
blocks = batch * (-(-(8 + max_tokens) // 16) + 1)
engine = LLMEngine(EngineConfig(model=config, cache=CacheConfig(16, blocks, torch.float32),
                                scheduler=SchedulerConfig(max_num_batched_tokens=max(512, batch * 8), max_num_seqs=batch,
                                                          max_model_len=8 + max_tokens + 8),
                                device=DeviceConfig(torch.device("cpu"), torch.float32),
                                kernels=KernelConfig("torch", True)), model=model)
params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
kwargs = {}
try:
    from kvflow.outputs import RequestOutputKind
    kwargs["output_kind"] = RequestOutputKind.FINAL_ONLY  # as LLM.generate asks
except ImportError:
    pass
for i in range(batch):
    engine.add_request(str(i), [(7 * i + j) % 128 for j in range(8)], params, **kwargs)
engine.step()  # the prefills
times, finished = [], 0
while engine.has_unfinished_requests():
    t = time.perf_counter()
    outs = engine.step()
    times.append(time.perf_counter() - t)
    finished += sum(o.finished for o in outs)
assert finished == batch, finished
q = max(1, len(times) // 4)
print(json.dumps({"seconds": sum(times), "steps": len(times), "growth": sum(times[-q:]) / sum(times[:q])}))
'''


def run(tree: Path, batch: int, max_tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "KVFLOW_CPU_KERNELS": "0", "KVFLOW_CPU_ADAPTIVE_THREADS": "0"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(batch), str(max_tokens)], cwd=tree, env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.output_processing", description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="root of the baseline checkout")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/output_processing.json")
    args = p.parse_args(argv)
    trees = {"baseline": args.baseline.resolve(), "this tree": ROOT}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            runs[name].append(run(tree, args.batch, args.max_tokens))
    rows, record = [], {}
    for name, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        steps = results[0]["steps"]
        growth = statistics.median(r["growth"] for r in results)
        record[name] = {"tree": str(trees[name]), "runs": results, "median_seconds": seconds}
        rows.append([name, steps, seconds, steps / seconds, growth])
    base = record["baseline"]["median_seconds"] / record["this tree"]["median_seconds"]
    from benchmarks.common import format_table

    print(f"{args.batch} requests x {args.max_tokens} tokens, logprobs=1, tiny random model; "
          f"CPU: {platform.processor() or platform.machine()}; measured on a loaded machine")
    print(format_table(["tree", "decode steps", "seconds (median)", "steps/s", "last/first quarter"], rows))
    print(f"speed-up of this tree: {base:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"batch": args.batch, "max_tokens": args.max_tokens, "speedup": base,
                                    "trees": record}, indent=2))


if __name__ == "__main__":
    main()
