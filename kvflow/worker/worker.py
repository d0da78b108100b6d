"""One rank's model, KV cache and runner: what a tensor-parallel worker builds for itself from
the engine's ``EngineConfig`` (and the driver, rank 0, for its own shard).

Every rank loads its shard of the model (``kvflow.model.loader.build_model`` with its
``TensorParallel`` place) and a KV block pool of the same number of blocks (sized once by
``EngineArgs.create_config`` for the rank holding the most KV heads, so that one block
table serves every rank), and runs the attention backend the selector picks from the same
config (the same on every rank).
"""

from __future__ import annotations

import torch

from kvflow import envs, ops
from kvflow.attention.backend import AttentionBackend
from kvflow.attention.selector import select_attention_backend
from kvflow.config import EngineConfig
from kvflow.distributed.parallel_state import TensorParallel
from kvflow.model.loader import build_model
from kvflow.ops.build import CppKernel
from kvflow.sample.sampler import Sampler
from kvflow.worker.cache_engine import CacheEngine
from kvflow.worker.model_runner import ModelRunner


def build_shard(config: EngineConfig, rank: int = 0):
    """Rank ``rank``'s model shard (the whole model without tensor parallelism).

    Raises:
        ValueError: see ``build_model``.
    """
    load, device = config.load, config.device
    world = config.parallel.tensor_parallel_size
    tp = TensorParallel(rank, world) if world > 1 else None
    return build_model(config.model, load.model_dir, device.dtype, device.device, load.quantization, load.group_size,
                       tp, load.quantize_lm_head)


def start_cpu_kernel_builds(config: EngineConfig) -> list[CppKernel]:
    """Start building, in the background, the C++ CPU kernels this engine would use that are
    not built yet (``kvflow.ops.build.start_background_builds``): the GGUF matmul for a model
    computed as stored, paged attention, RMSNorm, rotary, and the INT8 linear for an
    INT8-quantized model, in that order. Only on the CPU,
    without tensor parallelism (ranks must switch at the same step) and with
    ``KVFLOW_CPU_KERNEL_BUILD=background`` (the default); elsewhere nothing starts and each
    kernel is built on its first use, as before.

    Returns:
        The kernels building in the background; the engine publishes each between two steps
        once it is built (``kvflow.ops.publish_background_builds``).
    """
    if (config.device.device.type != "cpu" or config.parallel.tensor_parallel_size > 1
            or envs.KVFLOW_CPU_KERNEL_BUILD != "background"):
        return []
    kernels = [ops.PAGED_ATTENTION, ops.RMS_NORM, ops.ROTARY]
    if config.load is not None and config.load.quantization == "gguf":
        kernels.insert(0, ops.GGUF_MATMUL)  # a GGUF model's linears: most of its step
    if config.load is not None and "int8" in (config.load.quantization, config.load.quantize_lm_head):
        kernels.append(ops.INT8_LINEAR)
    if config.load is not None and config.load.quantization == "gguf":
        kernels.append(ops.FUSED_DECODE)  # its decode steps in one call (kvflow.layers.fused_decode)
    return ops.start_background_builds(kernels)


def attention_backend_for(config: EngineConfig, log: bool = True) -> AttentionBackend:
    """The engine's attention backend (``kvflow.attention.selector``)."""
    return select_attention_backend(config.kernels.attention_backend, config.device.device, config.device.dtype,
                                    config.cache.dtype, log=log, sliding_window=any(config.model.sliding_windows))


def build_rank(config: EngineConfig, rank: int) -> ModelRunner:
    """A tensor-parallel worker's model runner (it samples nothing)."""
    model = build_shard(config, rank)
    device = config.device.device
    cache = CacheEngine(model.kv_cache_spec, config.cache, device)
    return ModelRunner(model, cache, config.cache.block_size, Sampler(torch.Generator(device=device)), device,
                       is_driver=False, attention_backend=attention_backend_for(config, log=False))


class Worker:
    """Rank 0's device side, built from the whole ``EngineConfig`` in one place: the
    platform chores (background C++ kernel builds, the CPU thread governor), the attention
    backend, the tensor-parallel workers, the model shard, the KV cache, the LoRA slots, the
    model runner and the decode CUDA graphs (vLLM's ``Worker`` + executor, at kvflow's
    size). The speculative proposer, which drives a runner of its own, is the engine
    core's (``kvflow.engine.core.make_proposer``).

    Args:
        config: the engine's ``EngineConfig``.
        model: a loaded model to run instead of loading ``config.load`` (tests; no
            tensor-parallel workers are started then).

    Raises:
        ValueError: a model that cannot be loaded as configured, an attention backend that
            cannot run here (``kvflow.attention.selector``).
    """

    def __init__(self, config: EngineConfig, model=None) -> None:
        from kvflow.cpu_threads import ThreadGovernor, thread_governor
        from kvflow.distributed.worker import TPWorkers, torchrun_rank

        self.config = config
        device = config.device.device
        self.device = device
        # C++ CPU kernels not built yet build in the background while PyTorch's paths serve;
        # between_steps() switches to each between two steps (never inside one).
        self.kernel_builds = start_cpu_kernel_builds(config)
        # (after the builds start: the selector takes the CPU backend while its kernel builds)
        backend = attention_backend_for(config)
        self.attention_backend = backend
        # Fits the CPU thread count to the free cores between steps (kvflow.cpu_threads). Not
        # with tensor parallelism: the ranks share the machine's cores and each would count
        # the others as load.
        self.thread_governor: ThreadGovernor | None = None
        if device.type == "cpu" and config.parallel.tensor_parallel_size == 1:
            self.thread_governor = thread_governor(config.device.num_threads or torch.get_num_threads(),
                                                   explicit=config.device.num_threads is not None)
        self.tp_workers = None
        if model is None:
            if config.parallel.tensor_parallel_size > 1:
                self.tp_workers = TPWorkers(config, spawn=torchrun_rank() is None, build_rank=build_rank)
            try:
                model = build_shard(config, 0)
            except BaseException:
                self.shutdown()
                raise
        self.model = model
        self.cache_engine = CacheEngine(model.kv_cache_spec, config.cache, device)  # this rank's shard of heads
        generator = torch.Generator(device=device)
        generator.manual_seed(config.seed)
        self.lora_manager = None
        if config.lora is not None:
            from kvflow.lora.manager import LoRAManager

            lora = config.lora
            self.lora_manager = LoRAManager(model, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras)
        self.model_runner = ModelRunner(
            model, self.cache_engine, config.cache.block_size, Sampler(generator), device,
            broadcast=self.tp_workers.broadcast if self.tp_workers is not None else None,
            attention_backend=backend, lora_manager=self.lora_manager,
        )
        # Decode CUDA graphs: on CUDA, with a backend that has graph-safe metadata, without
        # tensor parallelism (the workers run eagerly: their collectives would not match).
        if device.type == "cuda" and backend.supports_cuda_graphs and not config.kernels.enforce_eager \
                and self.tp_workers is None and config.parallel.tensor_parallel_size == 1 \
                and config.cache.kv_cache_groups is None:  # (hybrid caches: eager, per-group metadata)
            from kvflow.worker.cuda_graph import DecodeGraphRunner, default_batch_sizes

            self.model_runner.graph_runner = DecodeGraphRunner(
                model, self.cache_engine.kv_caches, -(-config.scheduler.max_model_len // config.cache.block_size),
                default_batch_sizes(config.scheduler.max_num_seqs), device, backend,
            )

    def between_steps(self) -> None:
        """The platform's chores between two steps, on the thread that runs the forwards:
        fit the CPU thread count to the free cores, switch to the C++ kernels built since."""
        if self.thread_governor is not None:
            threads = self.thread_governor.update()
            if torch.get_num_threads() != threads:  # (per OS thread under OpenMP)
                torch.set_num_threads(threads)
        if self.kernel_builds:  # between two steps: no forward of this engine is running
            ops.publish_background_builds(self.kernel_builds)
            self.kernel_builds = [k for k in self.kernel_builds if k.pending()]

    def execute_model(self, scheduler_output):
        """Run one batch (``ModelRunner.execute``; the TP workers get it by broadcast)."""
        return self.model_runner.execute(scheduler_output)

    def get_stats(self) -> dict[str, float | int]:
        """With a CPU thread governor: num_cpu_threads, cpu_other_load, num_cpu_thread_changes."""
        governor = self.thread_governor
        if governor is None:
            return {}
        return {"num_cpu_threads": governor.threads, "cpu_other_load": governor.others,
                "num_cpu_thread_changes": governor.num_changes}

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op without them)."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()

