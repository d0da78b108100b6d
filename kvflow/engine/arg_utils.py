"""User-facing engine options, and their resolution into the engine's ``EngineConfig``.

``EngineArgs`` is the flat, user-facing set of options (the keyword arguments of ``LLM`` and
the CLI flags; vLLM's ``vllm.engine.arg_utils.EngineArgs``). ``EngineArgs.create_config()``
validates them and resolves everything once, in one order: the model argument -> a Hugging
Face-format folder (``kvflow.model.resolve``) -> its transformers config -> ``ModelConfig``
(with the architecture's ``ArchSpec`` facts, ``kvflow.model.registry.model_config``) -> the
KV cache geometry and block pool. The engine, its workers and the loader receive that
``EngineConfig`` (``kvflow.config``) and never resolve again.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from kvflow import envs
from kvflow.attention.selector import ATTENTION_BACKENDS, check_attention_backend_name
from kvflow.config import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    DEFAULT_SWAP_SPACE_BYTES,
    DTYPE_NAMES,
    KV_CACHE_DTYPE_NAMES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KernelConfig,
    KVCacheSpec,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    _positive_int,
    groups_page_spec,
    hybrid_kv_cache_groups,
    resolve_kv_cache_dtype,
)
from kvflow.platforms import platform_for
from kvflow.quantization.registry import LM_HEAD_METHODS, QUANTIZATION_METHODS
from kvflow.utils import parse_bytes


MAX_THREADS_PER_CPU = 8  # num_threads' bound: oversubscription allowed, not a count OpenMP cannot start
MAX_LORAS = 256  # max_loras' bound (adapter slots of one step)
MAX_CPU_LORAS = 4096  # max_cpu_loras' bound (validated adapters held in host memory)
MAX_LORA_RANK = 512  # max_lora_rank' bound (vLLM's largest rank)


def _option(default: Any, help: str, **cli: Any) -> Any:
    """A dataclass field carrying its documentation: ``help`` is the one text from which the
    class docstring's Attributes section and the CLI flag's help are made; ``cli`` holds
    hints for the flag (``choices``, ``metavar``, ``byte_size``: also parsed from strings
    such as "1GiB" by ``EngineArgs``, ``method_flag``)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    """User-facing engine options (the keyword arguments of ``LLM`` and the CLI flags).

    Each field's documentation is its ``help`` metadata (``EngineArgs.help_text(name)``),
    listed below; the CLI makes one flag per field from it (``--block-size``...).
    """

    model: str = _option(
        "smollm2-135m",
        "a short name of a packaged model (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma3-270m), "
        "a .gguf file or a Hugging Face directory (see docs/models.md)")
    dtype: str = _option(
        "auto", "weight and activation dtype: auto (bfloat16 on CUDA and on a CPU whose oneDNN runs bfloat16 "
        "natively, AVX512-BF16 / AMX-BF16; float32 on other CPUs), float32 (the exactness reference), bfloat16, "
        "float16", choices=("auto", *DTYPE_NAMES))
    device: str | None = _option(None, "cpu or cuda (default: cuda when available)")
    block_size: int = _option(16, "tokens per KV cache block")
    num_kv_blocks: int | None = _option(None, "number of KV blocks; overrides kv_cache_memory_bytes")
    kv_cache_memory_bytes: int | None = _option(
        None, "memory budget for the KV cache: bytes, or a size such as 512MiB, 1GiB (default: 512MiB)",
        byte_size=True)
    max_num_batched_tokens: int = _option(2048, "per-step token budget (prefill chunks plus decodes)")
    max_num_seqs: int = _option(64, "maximum number of concurrently running requests")
    max_step_seconds: float = _option(
        1.0, "bound on one engine step's duration: the step's token budget is cut to the tokens a step is "
        "predicted to compute in this many seconds, its measured duration fitted as a fixed part plus a part "
        "per token (long prompts then prefill in smaller chunks on a slow or loaded CPU, so that an abort or a "
        "new request waits at most about this long); 0: no bound",
        metavar="SECONDS")
    max_model_len: int | None = _option(None, "context limit in tokens (default: the model's)")
    enable_prefix_caching: bool = _option(True, "reuse cached K/V of shared prompt prefixes")
    disable_hybrid_kv_cache_manager: bool = _option(
        False, "for a model with both sliding-window and full-attention layers (Gemma 3), keep every layer's "
        "KV blocks for the whole context instead of freeing the sliding layers' blocks behind their window")
    scheduling_policy: str = _option("fcfs", "fcfs (arrival order) or priority (lower priority value first)",
                                     choices=("fcfs", "priority"))
    preemption_mode: str = _option("recompute", "recompute or swap (to host memory) when KV blocks run out",
                                   choices=("recompute", "swap"))
    swap_space_bytes: int | None = _option(
        None, "host memory for swapped-out KV blocks: bytes, or a size such as 256MiB (default: 256MiB with "
        "preemption_mode swap, else 0)", byte_size=True)
    quantization: str | None = _option(
        None, "weight-only quantization at load: gguf (compute a GGUF file's quantized tensors as stored, with "
        "native int8-dot kernels; the default for a GGUF model on the CPU unless dtype is float32), int8, int4 "
        "(round-to-nearest), int4-awq, fp8, or none (float weights; a GGUF file is dequantized). A quantized "
        "checkpoint folder (kvflow quantize) loads as saved: leave this unset or give its scheme", choices=(*QUANTIZATION_METHODS, "none"))
    quantization_group_size: int = _option(
        32, "INT4 group size: 32, 64 or 128 (32 measured far better than 128 on SmolLM2)", choices=(32, 64, 128))
    quantize_lm_head: bool | str = _option(
        False, "also quantize the LM head: True takes the decoder's scheme (INT4 for int4 / int4-awq, INT8 for "
        "int8 and gguf, FP8 for fp8); int8, int4 or fp8 picks one (e.g. an INT8 head under INT4 decoder "
        "linears). The embedding lookup stays float. Needs quantization (or a quantized checkpoint)",
        choices=LM_HEAD_METHODS, method_flag="--lm-head-quantization")
    kv_cache_dtype: str = _option(
        "auto", "KV cache element type: auto (the model dtype), int8 or fp8 (per-token, per-head scales; "
        "dequantized inside attention), or a float dtype name", choices=KV_CACHE_DTYPE_NAMES)
    speculative_config: dict[str, Any] | None = _option(
        None, 'speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4} (a JSON object on '
        "the command line; see SpeculativeConfig); default: off", metavar="JSON")
    tensor_parallel_size: int = _option(
        1, "shard the model over this many processes (Megatron-style tensor parallelism on torch.distributed: "
        "gloo on the CPU, NCCL on CUDA)")
    collective_timeout_s: float | None = _option(
        None, "seconds a tensor-parallel rank waits at the start-up rendezvous (while the other ranks load "
        "their shards) and in each collective before failing; a rank that exits is detected at once whatever "
        f"this says (default: $KVFLOW_COLLECTIVE_TIMEOUT_S, else {DEFAULT_COLLECTIVE_TIMEOUT_S:.0f})",
        metavar="SECONDS")
    seed: int = _option(0, "seed of the engine's generator for requests without their own seed")
    num_threads: int | None = _option(
        None, "CPU threads for the model (torch intra-op threads); at most 8 a CPU of the machine; default: torch's choice")
    model_cache_dir: str | None = _option(
        None, "where converted GGUF models are cached (default: $KVFLOW_CACHE_DIR or ~/.cache/kvflow/models)")
    attention_backend: str = _option(
        "auto", "auto (on CUDA: triton when the triton package is installed; on the CPU: cpu when its kernel "
        "builds; else torch), torch (gather + scaled_dot_product_attention, any device), cpu (decode attention "
        "in kvflow's C++ kernel, built on first use; prefill as torch) or triton (needs CUDA, or Triton's CPU "
        "interpreter with TRITON_INTERPRET=1, for tests only)", choices=ATTENTION_BACKENDS)
    pooling: str = _option(
        "last", "how embedding requests (LLM.embed, POST /v1/embeddings) pool the final hidden states when "
        "they do not choose: last (the prompt's last token) or mean (all prompt tokens; no prefix-cache hits)",
        choices=("last", "mean"))
    enforce_eager: bool = _option(
        False, "never use CUDA graphs (otherwise, on CUDA with the triton backend and no tensor parallelism, "
        "decode steps replay CUDA graphs captured at load)")
    enable_lora: bool = _option(
        False, "serve LoRA adapters (PEFT folders) on top of the base model, chosen per request (LoRARequest; on "
        "the server a request's model names the adapter) and mixed in one batch (see docs/lora.md)")
    max_loras: int = _option(1, f"with enable_lora: distinct adapters one step may use (the slot table's size; "
                             f"at most {MAX_LORAS})")
    max_lora_rank: int = _option(16, f"with enable_lora: the largest adapter rank r accepted (at most {MAX_LORA_RANK})")
    max_cpu_loras: int | None = _option(
        None, "with enable_lora: validated adapters kept in host memory, least recently used evicted (default: "
        "max_loras; at least max_loras)")

    def __post_init__(self) -> None:
        # Byte sizes may be written as users write them ("1GiB"); the engine reads ints.
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("byte_size") and isinstance(value, str):
                setattr(self, f.name, parse_bytes(value, f.name))

    @classmethod
    def help_text(cls, name: str) -> str:
        """The documentation of field ``name``.

        Raises:
            KeyError: for a name that is not a field.
        """
        return cls.__dataclass_fields__[name].metadata["help"]

    def verify(self) -> None:
        """Check the ranges of the numeric options.

        Raises:
            ValueError: naming the field that is out of range.
        """
        _positive_int("block_size", self.block_size)
        for name in ("enable_prefix_caching", "disable_hybrid_kv_cache_manager", "enforce_eager", "enable_lora"):
            # (a string such as "false" was truthy: prefix caching stayed on)
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63:
            # (torch's manual_seed failed later: "manual_seed expected a long, but got str")
            raise ValueError(f"seed must be an integer that fits in a signed 64-bit integer, got {self.seed!r}")
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        if isinstance(self.max_step_seconds, bool) or not isinstance(self.max_step_seconds, (int, float)) or not (
                0 <= self.max_step_seconds < float("inf")):
            raise ValueError(f"max_step_seconds must be a number of seconds >= 0, got {self.max_step_seconds!r}")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory_bytes is not None:
            _positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
            cpus = os.cpu_count()
            if cpus is not None and self.num_threads > MAX_THREADS_PER_CPU * cpus:
                # (num_threads=10**6 had OpenMP fail to start its threads and the process crash;
                # a few threads a CPU, oversubscribed on purpose, are the user's call)
                raise ValueError(f"num_threads must be at most {MAX_THREADS_PER_CPU} x this machine's {cpus} CPUs "
                                 f"= {MAX_THREADS_PER_CPU * cpus}, got {self.num_threads}")
        if self.model_cache_dir is not None and not isinstance(self.model_cache_dir, (str, os.PathLike)):
            # (it failed while resolving the model: "expected str, bytes or os.PathLike object, not int")
            raise ValueError(f"model_cache_dir must be a folder path, got {self.model_cache_dir!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.swap_space_bytes is not None and (
            isinstance(self.swap_space_bytes, bool) or not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0
        ):
            raise ValueError(f"swap_space_bytes must be a non-negative integer, got {self.swap_space_bytes!r}")
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)
        from kvflow.quantization.registry import check_method

        if self.quantization != "none":
            check_method(self.quantization)
        resolve_kv_cache_dtype(self.kv_cache_dtype, torch.float32)
        if not isinstance(self.quantize_lm_head, bool) and self.quantize_lm_head not in LM_HEAD_METHODS:
            raise ValueError(f"quantize_lm_head must be True, False or one of {', '.join(LM_HEAD_METHODS)}, "
                             f"got {self.quantize_lm_head!r}")
        if self.quantization_group_size not in (32, 64, 128):
            raise ValueError(f"quantization_group_size must be 32, 64 or 128, got {self.quantization_group_size!r}")
        if self.quantization_group_size != 32 and self.quantization not in ("int4", "int4-awq"):
            raise ValueError(f"quantization_group_size={self.quantization_group_size} is for the INT4 methods "
                             f"(quantization='int4' or 'int4-awq'), not quantization={self.quantization!r}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device is not None and self.device != "cpu" and not torch.cuda.is_available():
            why = "this PyTorch build has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
            raise ValueError(f"device={self.device!r}, but {why} (torch {torch.__version__}); use device='cpu' "
                             "or leave device unset to pick CUDA only when it is available")
        if self.collective_timeout_s is not None and (
            isinstance(self.collective_timeout_s, bool) or not isinstance(self.collective_timeout_s, (int, float))
            or not 0 < self.collective_timeout_s < float("inf")
        ):
            raise ValueError(f"collective_timeout_s must be a positive number of seconds, got {self.collective_timeout_s!r}")
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {self.pooling!r}")
        check_attention_backend_name(self.attention_backend)
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        # every slot holds max_lora_rank-wide A and B matrices of every adapted linear, allocated
        # at load: beyond these the allocation failed with a bare RuntimeError (vLLM's largest
        # rank is 512 too)
        for name, value, bound in (("max_loras", self.max_loras, MAX_LORAS), ("max_lora_rank", self.max_lora_rank, MAX_LORA_RANK),
                                   ("max_cpu_loras", self.max_cpu_loras, MAX_CPU_LORAS)):
            if isinstance(value, int) and value > bound:
                raise ValueError(f"{name} must be at most {bound}, got {value}")
        if self.max_cpu_loras is not None:
            _positive_int("max_cpu_loras", self.max_cpu_loras)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora is not supported with tensor_parallel_size > 1 (kvflow's LoRA deltas are not "
                             "sharded yet); serve adapters with tensor_parallel_size=1")

    def resolved_collective_timeout_s(self) -> float:
        """``collective_timeout_s``, else ``$KVFLOW_COLLECTIVE_TIMEOUT_S``, else the default.

        Raises:
            ValueError: for an environment value that is not a positive number.
        """
        if self.collective_timeout_s is not None:
            return float(self.collective_timeout_s)
        value = envs.KVFLOW_COLLECTIVE_TIMEOUT_S
        return DEFAULT_COLLECTIVE_TIMEOUT_S if value is None else value

    def resolved_quantization(self, requested: str | None, model_dir: str | os.PathLike, device: torch.device,
                              name: str | None = None) -> str | None:
        """The scheme a model loads with: ``requested`` ("none" -> None); when unset, "gguf" for
        a GGUF model on the CPU (computed as stored) unless ``dtype`` is explicitly "float32"
        (the exactness reference: the file's blocks dequantized); else None.

        Raises:
            FileNotFoundError: the folder's GGUF file is gone.
            ValueError: "gguf" asked of a model that is no GGUF file (nor a saved checkpoint),
                naming it (``name``: the model as the user gave it; default ``self.model``);
                a scheme (or "none") other than a saved quantized checkpoint's own, which
                loads as saved (it was ignored).
        """
        from kvflow.quantization.checkpoint import quantization_of
        from kvflow.quantization.registry import canonical_name
        from kvflow.model.resolve import gguf_source

        saved = quantization_of(model_dir)
        if saved is not None and requested is not None and canonical_name(requested) != saved["method"]:
            raise ValueError(f"quantization={requested!r}: {name or self.model!r} is a checkpoint saved quantized with "
                             f"{saved['method']!r} (kvflow quantize), which loads as saved; leave quantization unset or "
                             f"give {saved['method']!r}")
        if requested == "none":
            return None
        if requested == "gguf" and gguf_source(model_dir) is None and quantization_of(model_dir) is None:
            raise ValueError(f"quantization='gguf' computes a GGUF file's quantized tensors as stored; "
                             f"{name or self.model!r} is not a GGUF model (quantize a float model at load with int8, "
                             "int4, int4-awq or fp8)")
        if requested is not None:
            return requested
        if device.type == "cpu" and self.dtype != "float32" and gguf_source(model_dir) is not None:
            return "gguf"
        return None

    def create_config(self, replicas: int = 1) -> EngineConfig:
        """Validate the options and make the engine's ``EngineConfig``: resolve the model (a
        packaged short name or GGUF file is converted once into a cached folder), read its
        architecture (and the draft model's), and size the KV block pool.

        Args:
            replicas: how many engines with these options will run on this machine
                (``kvflow serve --data-parallel-size``): their KV pools must fit the available
                memory together.

        Raises:
            ValueError: naming the field, for an invalid option, an unsupported model, or a
                budget that holds no block.
            FileNotFoundError: for a model path that does not exist.
        """
        from kvflow.model.loader import resolve_load_config
        from kvflow.model.resolve import resolve_model_config

        self.verify()
        spec = SpeculativeConfig.from_dict(self.speculative_config) if self.speculative_config is not None else None
        # 1. The models, once, in one order: argument -> HF folder -> transformers config ->
        #    ModelConfig (the architecture's ArchSpec applied). Nothing downstream resolves again.
        model_dir, model_config = resolve_model_config(self.model, self.model_cache_dir, self.max_model_len)
        draft_dir = draft_model = None
        if spec is not None and spec.method == "draft_model":
            draft_dir, draft_model = resolve_model_config(spec.model, self.model_cache_dir)
            if draft_model.vocab_size != model_config.vocab_size:
                raise ValueError(
                    f"speculative_config.model has vocab_size {draft_model.vocab_size}, the target "
                    f"{model_config.vocab_size}: the draft must share the target's vocabulary"
                )
        # 2. How they load and run.
        device = self.torch_device()
        dtype = platform_for(device).resolve_dtype(self.dtype)  # ("auto": the platform's choice)
        # (what each folder holds, a saved quantized checkpoint's scheme included, before loading)
        quantization = self.resolved_quantization(self.quantization, model_dir, device)
        load = resolve_load_config(self.model, model_dir, quantization, self.quantization_group_size,
                                   self.quantize_lm_head)
        draft = None
        if draft_dir is not None:
            draft_quantization = self.resolved_quantization(spec.quantization, draft_dir, device,
                                                            name=spec.model)
            draft = resolve_load_config(spec.model, draft_dir, draft_quantization, self.quantization_group_size)
        # 3. Batching and the KV cache geometry and pool.
        scheduler = self.scheduler_config(model_config)
        world = self.tensor_parallel_size
        if world > 1:
            # Every rank has as many blocks, sized for the rank holding the most KV heads (the
            # draft, on rank 0 only, comes on top of the budget).
            kv_spec = max((model_config.kv_cache_spec(world, r) for r in range(world)), key=lambda k: k.num_kv_heads)
            extra = 0
        else:
            # The draft's cache has as many blocks as the target's (it mirrors every request),
            # and both come out of the one KV budget.
            kv_spec = model_config.kv_cache_spec()
            kv_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, dtype)
            extra = draft_model.kv_bytes_per_token(kv_dtype) if draft_model is not None else 0
        groups = hybrid_kv_cache_groups(model_config, self.disable_hybrid_kv_cache_manager)
        if groups is not None:
            kv_spec = groups_page_spec(kv_spec, groups)  # a block is a page of group_size layers
        cache = self.cache_config(kv_spec, dtype, extra_bytes_per_token=extra, replicas=replicas)
        if groups is not None:
            cache = dataclasses.replace(cache, kv_cache_groups=groups)
        config = EngineConfig(
            model=model_config,
            cache=cache,
            scheduler=scheduler,
            device=DeviceConfig(device, dtype, self.num_threads),
            load=load,
            parallel=ParallelConfig(world, self.resolved_collective_timeout_s()),
            speculative=spec,
            kernels=KernelConfig(self.attention_backend, self.enforce_eager),
            seed=self.seed,
            lora=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras)
            if self.enable_lora else None,
        )
        # 4. The draft model's own config, from the target's (its pool has as many blocks).
        return config.with_draft(draft_model, draft) if draft_model is not None else config

    def torch_device(self) -> torch.device:
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def cache_config(self, kv_spec: KVCacheSpec, dtype: torch.dtype, extra_bytes_per_token: int = 0,
                     replicas: int = 1) -> CacheConfig:
        """Size the block pool from ``num_kv_blocks`` or the byte budget (``dtype``: the
        model dtype; the cache's own follows ``kv_cache_dtype``).

        Args:
            kv_spec: the KV cache geometry the pool holds (under tensor parallelism the rank
                with the most KV heads: every rank has the same blocks).
            dtype: the model dtype.
            extra_bytes_per_token: bytes per token of another cache with as many blocks,
                paid from the same budget (a draft model's), 0 for none.
            replicas: engines with this pool on this machine (see ``create_config``).

        Raises:
            ValueError: if the budget does not hold a single block, if under
                ``preemption_mode="swap"`` the swap space does not, or (on the CPU) if the
                pool does not fit the machine's available memory (``_check_host_memory``).
        """
        dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, dtype)
        bytes_per_block = kv_spec.bytes_per_token(dtype) * self.block_size
        if self.num_kv_blocks is not None:
            num_blocks = self.num_kv_blocks
        else:
            budget = self.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
            num_blocks = budget // (bytes_per_block + extra_bytes_per_token * self.block_size)
            if num_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory_bytes={budget} holds no block of "
                    f"{bytes_per_block + extra_bytes_per_token * self.block_size} bytes"
                )
        swap_space = self.swap_space_bytes
        if swap_space is None:
            swap_space = DEFAULT_SWAP_SPACE_BYTES if self.preemption_mode == "swap" else 0
        if self.preemption_mode == "swap" and swap_space < bytes_per_block:
            # (no block to swap to: every preemption would quietly recompute instead)
            # (named both ways: vLLM's swap_space / --swap-space in GiB arrives here in bytes)
            raise ValueError(f"swap_space_bytes={swap_space} (swap_space={swap_space / 2**30:.6g} GiB) holds no block "
                             f"of {bytes_per_block} bytes (preemption_mode='swap' swaps whole KV blocks to host memory)")
        if self.torch_device().type == "cpu":
            self._check_host_memory(num_blocks * (bytes_per_block + extra_bytes_per_token * self.block_size),
                                    num_blocks, swap_space, replicas)
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            dtype=dtype,
            enable_prefix_caching=self.enable_prefix_caching,
            num_cpu_blocks=swap_space // bytes_per_block,
        )

    def _check_host_memory(self, pool_bytes: int, num_blocks: int, swap_space: int, replicas: int = 1) -> None:
        """On the CPU the KV pool is allocated and zeroed at start (resident, not lazily
        mapped): one larger than the memory the machine has available would only end in the
        kernel's OOM killer. Every tensor-parallel rank holds its own pool, and every replica
        (``replicas``, each with its own swap space); the swap space is host memory too.

        Raises:
            ValueError: naming ``num_kv_blocks`` or ``kv_cache_memory_bytes`` (whichever sized
                the pool) when the pools and the swap space exceed the available memory.
        """
        import psutil

        world = max(1, self.tensor_parallel_size)
        replicas = max(1, replicas)
        need = (pool_bytes * world + swap_space) * replicas
        available = psutil.virtual_memory().available
        if need <= available:
            return
        field = ("num_kv_blocks", self.num_kv_blocks) if self.num_kv_blocks is not None else (
            "kv_cache_memory_bytes", self.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES)
        ranks = f" on each of {world} ranks" if world > 1 else ""
        ranks += f" in each of {replicas} replicas" if replicas > 1 else ""
        swap = f" plus {swap_space / 2**30:.2f} GiB of swap space" if swap_space else ""
        raise ValueError(
            f"{field[0]}={field[1]}: the KV cache needs {pool_bytes / 2**30:.2f} GiB ({num_blocks} blocks){ranks}"
            f"{swap}, more than the {available / 2**30:.2f} GiB of memory available on this machine; lower it"
        )

    def scheduler_config(self, model_config: ModelConfig) -> SchedulerConfig:
        """The batching limits; the context limit is ``max_model_len`` or the model's.

        Raises:
            ValueError: for a ``max_model_len`` beyond the model's context.
        """
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context "
                f"({model_config.max_position_embeddings} tokens)"
            )
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            policy=self.scheduling_policy,
            preemption_mode=self.preemption_mode,
            max_step_seconds=float(self.max_step_seconds),
            max_loras=self.max_loras if self.enable_lora else 0,
        )


def _attributes_doc(cls: type) -> str:
    """An "Attributes:" docstring section from the fields' ``help`` metadata."""
    import textwrap

    lines = ["", "    Attributes:"]
    for f in fields(cls):
        lines += textwrap.wrap(f"{f.name}: {f.metadata['help']}.", width=92, initial_indent=" " * 8,
                               subsequent_indent=" " * 12)
    return "\n".join(lines) + "\n"


EngineArgs.__doc__ = (EngineArgs.__doc__ or "").rstrip() + "\n" + _attributes_doc(EngineArgs)

# vLLM's ``AsyncEngineArgs`` (its ``EngineArgs`` plus server logging switches): kvflow's engine
# options are the same for the asyncio engine (``kvflow.AsyncLLMEngine``).
AsyncEngineArgs = EngineArgs
