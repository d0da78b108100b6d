"""The ``kvflow`` command line: ``kvflow generate``, ``kvflow chat`` and ``kvflow memory``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvflow.config import EngineArgs
from kvflow.quantization.registry import LM_HEAD_METHODS
from kvflow.distributed.worker import torchrun_rank


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineArgs()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=defaults.model, help="short name (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b), .gguf file or HF directory")
    g.add_argument("--dtype", default=defaults.dtype, help="auto, float32, bfloat16, float16")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="number of KV blocks (overrides --kv-cache-memory-bytes)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV cache budget in bytes (default 512 MiB)")
    g.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens, help="per-step token budget")
    g.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs, help="max concurrently running requests")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens")
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--quantization", default=None, help="int8, int4, int4-awq, fp8 or gguf (weight-only)")
    g.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize the LM head too, with the decoder's scheme (embeddings stay float)")
    g.add_argument("--lm-head-quantization", choices=list(LM_HEAD_METHODS), default=None,
                   help="quantize the LM head with this scheme (implies --quantize-lm-head)")
    g.add_argument("--kv-cache-dtype", default="auto", help="auto, int8, fp8 or a float dtype")
    g.add_argument("--speculative-config", type=json.loads, default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="processes the model is sharded over")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn automatic prefix caching off")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    g.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    g.add_argument("--swap-space-bytes", type=int, default=None, help="host memory for swapped KV blocks")
    g.add_argument("--attention-backend", choices=["auto", "torch", "cpu", "triton"], default=defaults.attention_backend,
                   help="paged attention: triton kernels (CUDA), cpu (C++ decode kernel) or torch (gather + SDPA); "
                   "auto: triton on CUDA, cpu on the CPU")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="max new tokens per reply")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="per-request seed")
    g.add_argument("--ignore-eos", action="store_true")


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = [
        "dtype", "device", "block_size", "num_kv_blocks", "kv_cache_memory_bytes",
        "max_num_batched_tokens", "max_num_seqs", "max_model_len", "num_threads",
        "enable_prefix_caching", "scheduling_policy", "preemption_mode", "swap_space_bytes",
        "quantization", "kv_cache_dtype", "speculative_config", "tensor_parallel_size",
        "attention_backend", "enforce_eager", "quantize_lm_head",
    ]
    kwargs = {n: getattr(args, n) for n in names}
    if args.lm_head_quantization is not None:
        kwargs["quantize_lm_head"] = args.lm_head_quantization
    return kwargs


def _sampling_params(args: argparse.Namespace):
    from kvflow.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvflow import LLM

    params = _sampling_params(args)
    llm = LLM(model=args.model, **_engine_kwargs(args))
    prompts = list(args.prompt)
    if args.chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        if len(prompts) > 1:
            print(f"=== {prompt}")
        print(out.outputs[0].text)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from kvflow import LLM

    params = _sampling_params(args)
    llm = LLM(model=args.model, **_engine_kwargs(args))
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("kvflow chat — empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        history.append({"role": "user", "content": user})
        prompt = {"prompt_token_ids": llm.apply_chat_template(history)}
        printed = 0
        text = ""
        for out in llm.generate_stream(prompt, params):
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": text})
    return 0


def _cmd_memory(args: argparse.Namespace) -> int:
    """KV cache sizes of a model from its config alone (see ``kvflow.core.memory``)."""
    import json

    from kvflow.core import memory

    spec = memory.load_kv_spec(args.model)
    report = memory.memory_report(
        spec,
        memory.kv_cache_dtype_for(args.kv_cache_dtype),
        block_size=args.block_size,
        budget_bytes=memory.parse_bytes(args.budget),
        max_model_len=args.max_model_len,
    )
    print(json.dumps(report, indent=2) if args.json else memory.format_report(report))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvflow.config import EngineArgs
    from kvflow.engine.async_engine import AsyncLLMEngine
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.entrypoints.openai.server import build_app

    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, **_engine_kwargs(args)))
    name = args.served_model_name or args.model
    async_engine = AsyncLLMEngine(engine, name, max_queue_len=args.max_queue_len)
    app = build_app(async_engine, name, engine.scheduler_config.max_model_len, api_key=args.api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    import torch

    from kvflow.model.loader import load_model, quantize_model
    from kvflow.model.resolve import load_tokenizer, resolve_model
    from kvflow.quantization.awq import default_calibration_ids
    from kvflow.quantization.checkpoint import save_quantized, weight_bytes

    if args.method == "int4-rtn":
        args.method = "int4"
    model_dir = resolve_model(args.model)
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    before = weight_bytes(model)
    calibration = None
    if args.method == "int4-awq":
        tokenizer = load_tokenizer(model_dir)
        if args.calibration:
            with open(args.calibration, encoding="utf-8") as f:
                calibration = tokenizer.encode(f.read())[: args.calibration_tokens]
        else:
            calibration = default_calibration_ids(tokenizer, args.calibration_tokens)
    quantize_model(model, args.method, args.group_size, calibration)
    out = save_quantized(model, model_dir, args.out, args.method, args.group_size)
    print(f"wrote {out}: {args.method}, weights {before / 2**20:.1f} MiB -> {weight_bytes(model) / 2**20:.1f} MiB")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow: LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    gen.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user message in the chat template")
    _add_engine_args(gen)
    _add_sampling_args(gen, max_tokens=64)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, printing tokens as they are generated")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=_cmd_chat)

    quant = sub.add_parser("quantize", help="write a weight-quantized checkpoint that LLM(model=DIR) loads")
    quant.add_argument("--model", default=EngineArgs().model)
    quant.add_argument("--method", required=True, choices=["int8", "int4", "int4-rtn", "int4-awq", "fp8"])
    quant.add_argument("--group-size", type=int, default=32, choices=[32, 64, 128], help="INT4 group size")
    quant.add_argument("--calibration", default=None, help="text file for AWQ (default: the GPL-3 text)")
    quant.add_argument("--calibration-tokens", type=int, default=512)
    quant.add_argument("--out", required=True, help="output folder")
    quant.set_defaults(func=_cmd_quantize)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    serve.add_argument("--served-model-name", default=None, help="model id in the API (default: --model)")
    serve.add_argument("--max-queue-len", type=int, default=None, help="refuse requests (429) while this many wait")
    serve.add_argument("--log-level", default="info")
    _add_engine_args(serve)
    serve.set_defaults(func=_cmd_serve)

    mem = sub.add_parser("memory", help="KV cache bytes per token/block, attention variants, what a budget holds")
    mem.add_argument("--model", default=EngineArgs().model, help="short name, .gguf file or HF directory (only its config is read)")
    mem.add_argument("--max-model-len", type=int, default=None, help="request length in tokens (default: the model's context)")
    mem.add_argument(
        "--kv-cache-dtype", default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp32", "bf16", "fp16", "half"],
        help="KV element type (auto: float32 on CPU, bfloat16 on CUDA, as the engine with its default --dtype; "
        "an engine run with --dtype bfloat16 has a bfloat16 cache: pass --kv-cache-dtype bfloat16)",
    )
    mem.add_argument("--budget", default="512MiB", help="KV cache budget: bytes or 512MiB, 8GiB, 2GB (default 512MiB)")
    mem.add_argument("--block-size", type=int, default=EngineArgs().block_size, help="tokens per KV block")
    mem.add_argument("--json", action="store_true", help="print the report as JSON")
    mem.set_defaults(func=_cmd_memory)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvflow`` console script. Invalid options exit with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    rank = torchrun_rank()
    if rank is not None and rank[0] != 0 and hasattr(args, "tensor_parallel_size"):
        # A non-zero torchrun rank serves the driver's steps on its shard; only rank 0 runs
        # the command itself (the engine, the server, the CLI output).
        from kvflow.distributed.worker import worker_main

        worker_main(rank[0], rank[1], "env://", EngineArgs(model=args.model, **_engine_kwargs(args)))
        return 0
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as exc:
        parser.exit(2, f"kvflow: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
