"""vLLM's ``LLM(...)`` keyword arguments on kvflow, so that a script written for
``vllm.LLM`` runs on ``kvflow.LLM`` by changing its import.

Each vLLM keyword is one of:

- the same option in kvflow (``EngineArgs`` has it: ``dtype``, ``max_model_len``,
  ``block_size``, ``enable_prefix_caching``, ``max_num_seqs``, ``max_num_batched_tokens``,
  ``tensor_parallel_size``, ``kv_cache_memory_bytes``, ``quantization``, ``seed``,
  ``enforce_eager``, ``kv_cache_dtype``, ``speculative_config``...), passed on (dtype
  "half" / "float" as vLLM's aliases of float16 / float32);
- mapped (``MAPPED``): ``gpu_memory_utilization`` sizes the KV cache as vLLM's CPU
  backend does (below), ``swap_space`` (GiB) is ``swap_space_bytes`` under
  ``preemption_mode="swap"``, ``pooler_config`` / ``override_pooler_config``'s
  ``pooling_type`` is ``pooling``, ``seed=None`` is seed 0;
- accepted with a logged note and no effect (``IGNORED``): options about downloads,
  logging, compilation, executors or tokenizer loading that do not change kvflow's
  outputs;
- refused with a ValueError naming it when set to a value kvflow cannot honour
  (``REFUSED_UNLESS``: e.g. ``pipeline_parallel_size`` other than 1, a ``tokenizer``
  other than the model's).

``gpu_memory_utilization`` (vLLM's CPU backend, vllm/v1/worker/cpu_worker.py, reads it as
the fraction of the machine's memory its worker may use; on CUDA the fraction of the GPU's):
the KV budget is ``fraction x total memory`` (RAM, or the CUDA device's) minus what this
process already uses (its resident set on the CPU, the CUDA memory reserved on the GPU)
minus the size of the model's weight files; a budget of zero or less is a ValueError. An
explicit ``kv_cache_memory_bytes`` or ``num_kv_blocks`` wins (as in vLLM).

Any other keyword is unknown and raises ValueError naming it (``LLM.__init__``).

The same options are flags of ``kvflow generate``, ``chat`` and ``serve`` (vLLM's ``vllm
serve`` flags: ``--trust-remote-code``, ``--gpu-memory-utilization 0.5``, ``--swap-space 4``,
``--enable-chunked-prefill``...), parsed as ``CLI_VALUE`` says and translated by
``translate_llm_kwargs`` as the keywords are; ``kvflow serve`` also takes ``SERVE_IGNORED``,
vLLM's server flags that change nothing in kvflow's server.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Accepted whatever their value, with a note: they change nothing kvflow computes.
IGNORED: dict[str, str] = {
    "trust_remote_code": "kvflow runs its own model classes, never a checkpoint's code",
    "tokenizer_mode": "kvflow loads the model folder's tokenizer with transformers' AutoTokenizer",
    "skip_tokenizer_init": "kvflow loads the tokenizer when the model folder has one",
    "revision": "models are local (a packaged name, a folder or a .gguf file)",
    "tokenizer_revision": "models are local",
    "code_revision": "models are local",
    "download_dir": "models are local (converted GGUF models are cached in model_cache_dir)",
    "hf_token": "models are local",
    "load_format": "kvflow reads safetensors / .bin / GGUF as it finds them",
    "disable_log_stats": "kvflow's offline engine logs no periodic stats",
    "disable_custom_all_reduce": "kvflow's tensor parallelism uses torch.distributed's all-reduce",
    "distributed_executor_backend": "kvflow's tensor parallelism runs its own worker processes",
    "max_seq_len_to_capture": "CUDA graphs: see enforce_eager",
    "compilation_config": "kvflow does not torch.compile the model",
    "use_tqdm_on_load": "kvflow shows no progress bar while loading",
    "disable_async_output_proc": "kvflow's outputs are processed synchronously",
    "async_scheduling": "kvflow's offline engine schedules synchronously",
    "enable_chunked_prefill": "kvflow always chunks prefills by max_num_batched_tokens",
    "max_logprobs": "kvflow's server takes up to 20 logprobs per token (OpenAI's bound), the offline API up to the "
                    "vocabulary's size",
    "served_model_name": "offline API: no model name is served",
    "limit_mm_per_prompt": "kvflow serves text models only",
    "allowed_local_media_path": "kvflow serves text models only",
    "enable_expert_parallel": "kvflow's MoE layers run on each tensor-parallel rank",
    "runner": "kvflow runs generation (generate, chat) and embeddings (embed) on one engine",
    "task": "kvflow runs generation (generate, chat) and embeddings (embed) on one engine",
    "convert": "kvflow runs generation (generate, chat) and embeddings (embed) on one engine",
}

# Accepted only at these values (vLLM's defaults or no-ops); any other is a ValueError.
REFUSED_UNLESS: dict[str, tuple[tuple[Any, ...], str]] = {
    "pipeline_parallel_size": ((1,), "kvflow has no pipeline parallelism (tensor_parallel_size shards the model)"),
    "data_parallel_size": ((1,), "kvflow runs one engine per process"),
    "cpu_offload_gb": ((0, 0.0), "kvflow does not offload weights"),
    "hf_overrides": ((None, {}), "kvflow reads the model's config as it is"),
    "mm_processor_kwargs": ((None, {}), "kvflow serves text models only"),
    "kv_transfer_config": ((None,), "kvflow has no KV transfer"),
    "logprobs_mode": ((None, "raw_logprobs"), "kvflow's logprobs are the raw model distribution's"),
    "generation_config": ((None, "auto"), "kvflow takes the sampling defaults of the model folder's "
                          "generation_config.json (vLLM's 'auto')"),
}

# Translated into kvflow's options (see the module docstring); the texts are the CLI flags' help.
MAPPED: dict[str, str] = {
    "gpu_memory_utilization": "the fraction of the memory (RAM on the CPU, the GPU's on CUDA) the engine may use: "
                              "sizes the KV cache (unless --kv-cache-memory-bytes or --num-kv-blocks is given)",
    "swap_space": "GiB of host memory for swapped-out KV blocks: --swap-space-bytes in GiB with --preemption-mode "
                  "swap (no effect otherwise)",
    "pooler_config": 'its pooling_type only, as --pooling (e.g. {"pooling_type": "MEAN"})',
    "override_pooler_config": "as --pooler-config",
    "tokenizer": "the model's own tokenizer only (equal to --model, or unset)",
}
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


# vLLM's ``vllm serve`` flags that are no ``LLM`` keywords, accepted by ``kvflow serve`` with a
# note: they change nothing kvflow's server does. (``--served-model-name`` and
# ``--uvicorn-log-level`` are ``kvflow serve``'s own flags.)
SERVE_IGNORED: dict[str, str] = {
    "disable_log_requests": "kvflow's server does not log requests",
    "enable_auto_tool_choice": "kvflow's server always takes tool_choice 'auto' (--tool-call-parser reads the calls)",
}

# How each option above is written on the command line: "flag" (--x / --no-x), "str", "int",
# "float", "json" (a JSON value: an object, a number...) or "strs" (one or more strings).
CLI_VALUE: dict[str, str] = {
    "trust_remote_code": "flag", "tokenizer_mode": "str", "skip_tokenizer_init": "flag", "revision": "str",
    "tokenizer_revision": "str", "code_revision": "str", "download_dir": "str", "hf_token": "str",
    "load_format": "str", "disable_log_stats": "flag", "disable_custom_all_reduce": "flag",
    "distributed_executor_backend": "str", "max_seq_len_to_capture": "int", "compilation_config": "json",
    "use_tqdm_on_load": "flag", "disable_async_output_proc": "flag", "async_scheduling": "flag",
    "enable_chunked_prefill": "flag", "max_logprobs": "int", "served_model_name": "strs",
    "limit_mm_per_prompt": "json", "allowed_local_media_path": "str", "enable_expert_parallel": "flag",
    "runner": "str", "task": "str", "convert": "str",
    "pipeline_parallel_size": "int", "data_parallel_size": "int", "cpu_offload_gb": "float", "hf_overrides": "json",
    "mm_processor_kwargs": "json", "kv_transfer_config": "json", "logprobs_mode": "str", "generation_config": "str",
    "gpu_memory_utilization": "float", "swap_space": "float", "pooler_config": "json",
    "override_pooler_config": "json", "tokenizer": "str",
    "disable_log_requests": "flag", "enable_auto_tool_choice": "flag",
}  # fmt: skip


def note_serve_options(options: dict[str, Any]) -> None:
    """Log the note of each ``SERVE_IGNORED`` option given (name -> value)."""
    for name, value in options.items():
        _note(name, value, f"accepted, no effect: {SERVE_IGNORED[name]}")


def vllm_option_names() -> set[str]:
    """Every vLLM keyword this module takes (beyond ``EngineArgs``' own fields)."""
    return {*IGNORED, *REFUSED_UNLESS, *MAPPED}


def _note(name: str, value: Any, what: str) -> None:
    logger.info("vLLM option %s=%r: %s", name, value, what)


def _weights_bytes(model_dir: Path) -> int:
    files = [model_dir] if model_dir.is_file() else list(model_dir.iterdir())
    return sum(f.stat().st_size for f in files if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES))


def _check_fraction(fraction: Any) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {fraction!r}")


def kv_budget_from_utilization(fraction: Any, model: str, device: str | None,
                               model_cache_dir: str | None = None) -> int:
    """The KV cache budget in bytes that ``gpu_memory_utilization=fraction`` means (see the
    module docstring).

    Raises:
        ValueError: naming gpu_memory_utilization, for a fraction outside (0, 1], one that
            leaves no memory for the KV cache, or (on the CPU) one whose budget exceeds the
            memory available on the machine.
    """
    import psutil
    import torch

    from kvflow.model.resolve import resolve_model

    _check_fraction(fraction)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        used = torch.cuda.memory_reserved(dev)
        where = "the CUDA device's memory"
    else:
        total = psutil.virtual_memory().total
        used = psutil.Process(os.getpid()).memory_info().rss
        where = "the machine's RAM"
    weights = _weights_bytes(Path(resolve_model(model, cache_dir=model_cache_dir)))
    budget = int(fraction * total) - used - weights
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={fraction} leaves no KV cache memory: {fraction} x {total / 2**30:.1f} GiB "
            f"({where}) minus {used / 2**30:.2f} GiB in use and {weights / 2**30:.2f} GiB of weights; raise it, or "
            "set kv_cache_memory_bytes"
        )
    if dev.type != "cuda":
        # The CPU pool is resident from the start: more than the machine has free (other
        # processes hold some of its RAM) would end in the OOM killer.
        available = psutil.virtual_memory().available
        if budget > available:
            raise ValueError(
                f"gpu_memory_utilization={fraction} asks for a {budget / 2**30:.2f} GiB KV cache ({fraction} x "
                f"{total / 2**30:.1f} GiB of RAM less what is in use), more than the {available / 2**30:.2f} GiB "
                "of memory available on this machine; lower it, or set kv_cache_memory_bytes"
            )
    return budget


def _pooling_type(name: str, config: Any) -> str | None:
    if not isinstance(config, dict) and not hasattr(config, "__dict__"):
        raise ValueError(f"{name} must be an object such as {{\"pooling_type\": \"MEAN\"}} (a dict or vLLM's "
                         f"PoolerConfig), got {type(config).__name__}")
    items = config if isinstance(config, dict) else {k: v for k, v in vars(config).items() if v is not None}
    unknown = sorted(k for k, v in items.items() if k != "pooling_type" and v is not None)
    if unknown:
        raise ValueError(f"{name}: only pooling_type is supported by kvflow (got {', '.join(unknown)})")
    pooling = items.get("pooling_type")
    return pooling.lower() if isinstance(pooling, str) else pooling


def translate_llm_kwargs(model: str, kwargs: dict[str, Any], engine_fields: set[str]) -> dict[str, Any]:
    """vLLM ``LLM(...)`` keywords as ``EngineArgs`` keywords (see the module docstring);
    the names that are neither (unknown) are passed through for the caller to refuse.

    Raises:
        ValueError: naming the option, for a vLLM option set to a value kvflow cannot
            honour, a ``gpu_memory_utilization`` that leaves no KV cache memory, or both
            ``swap_space`` and ``swap_space_bytes``.
    """
    out = {k: v for k, v in kwargs.items() if k not in vllm_option_names() or k in engine_fields}
    if isinstance(out.get("dtype"), str) and out["dtype"] in _DTYPE_ALIASES:
        out["dtype"] = _DTYPE_ALIASES[out["dtype"]]
    if "seed" in out and out["seed"] is None:
        out["seed"] = 0
        _note("seed", None, "kvflow's engine always has a seed; using 0")
    for name, value in kwargs.items():
        if name in engine_fields:
            continue
        if name in IGNORED:
            _note(name, value, f"accepted, no effect: {IGNORED[name]}")
        elif name in REFUSED_UNLESS:
            allowed, why = REFUSED_UNLESS[name]
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported by kvflow: {why}")
        elif name == "tokenizer":
            if value is not None and str(value) != str(model):
                raise ValueError(f"tokenizer={value!r} is not supported by kvflow: it loads the tokenizer of the model "
                                 f"({model!r}); leave tokenizer unset or equal to model")
        elif name == "swap_space":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"swap_space must be a finite non-negative number of GiB, got {value!r}")
            if kwargs.get("swap_space_bytes") is not None:
                raise ValueError("swap_space (GiB, vLLM's) and swap_space_bytes are the same option; give one")
            if kwargs.get("preemption_mode") == "swap":
                out["swap_space_bytes"] = int(value * 2**30)
            else:
                _note(name, value, "no effect: kvflow swaps only with preemption_mode='swap' (then this is "
                      "swap_space_bytes)")
        elif name in ("pooler_config", "override_pooler_config"):
            if value is not None:
                pooling = _pooling_type(name, value)
                if pooling is not None:
                    out["pooling"] = pooling
        elif name == "gpu_memory_utilization":
            _check_fraction(value)
            if kwargs.get("kv_cache_memory_bytes") is not None or kwargs.get("num_kv_blocks") is not None:
                _note(name, value, "no effect: kv_cache_memory_bytes / num_kv_blocks is set")
                continue
            budget = kv_budget_from_utilization(value, model, kwargs.get("device"), kwargs.get("model_cache_dir"))
            out["kv_cache_memory_bytes"] = budget
            _note(name, value, f"KV cache budget {budget / 2**30:.2f} GiB")
    return out
