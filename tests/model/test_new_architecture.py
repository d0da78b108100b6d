"""A new Llama-shaped architecture with GGUF loading is one model file and one registry line.

The "model file" is the block below marked as such: a transformers config class for the new
``model_type`` and a ``LlamaForCausalLM`` subclass whose ``arch_specs`` say everything kvflow
must know (GGUF architecture name, Q/K rows permuted as llama.cpp's ``LlamaModel.permute``
stores them, Q/K/V biases whatever the config says, the post-attention norm stored under
gguf-py's ``post_attention_norm`` name). The registry line is ``register_model``. Nothing
else in kvflow names the architecture: a GGUF file of it is read, its weights dequantized and
run by ``kvflow.LLM``, and the greedy tokens and log-probabilities equal the same weights
loaded as a float Hugging Face folder, and transformers' Llama greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from conftest import hf_greedy
from kvflow import LLM, SamplingParams
from kvflow.model.arch import ArchSpec
from kvflow.model.llama import LlamaForCausalLM
from kvflow.model.registry import arch_spec, register_model
from model.test_resolve import _llama_permute, _tiny_tokenizer

T = gguf.MODEL_TENSOR


# ---- the model file ------------------------------------------------------------------------
class KvTestConfig(transformers.LlamaConfig):
    model_type = "kvtest_llama"


class KvTestForCausalLM(LlamaForCausalLM):
    """Llama with Q/K/V biases (as Qwen2), saved in GGUF as architecture "kvtest"."""

    arch_specs = (ArchSpec(
        "kvtest_llama", KvTestConfig, hf_architecture="KvTestForCausalLM", gguf_arch="kvtest",
        gguf_qk_permuted=True, attention_bias=True,
        gguf_tensor_names={T.ATTN_POST_NORM: "post_attention_layernorm"},
    ),)


# ---- the registry line ---------------------------------------------------------------------
register_model(KvTestForCausalLM)
# ---------------------------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 96, 2
Q8 = gguf.GGMLQuantizationType.Q8_0


def _write(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a 2-layer "kvtest" GGUF (what llama.cpp's converter would write for it: Q/K rows
    permuted, ``token_embd`` and ``ffn_down`` as Q8_0, the rest F32) and return its weights as
    the float32 HF-layout tensors it stands for (the Q8_0 ones dequantized)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "kvtest")
    vocab = _tiny_tokenizer(writer)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    weights: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf_name: str, value: np.ndarray, stored: np.ndarray | None = None,
            q8: bool = False) -> None:
        data = value if stored is None else stored
        if q8:
            packed = gguf.quants.quantize(data, Q8)
            writer.add_tensor(gguf_name, packed, raw_dtype=Q8)
            value = gguf.quants.dequantize(packed, Q8).reshape(value.shape)
        else:
            writer.add_tensor(gguf_name, data)
        weights[hf_name] = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))

    def rand(*shape: int, std: float = 0.2) -> np.ndarray:
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def norm() -> np.ndarray:
        return 1.0 + rand(HIDDEN, std=0.1)

    add("token_embd.weight", "model.embed_tokens.weight", rand(vocab, HIDDEN), q8=True)
    for i in range(LAYERS):
        p, hf = f"blk.{i}.", f"model.layers.{i}."
        q, k = rand(HEADS * HEAD_DIM, HIDDEN), rand(KV_HEADS * HEAD_DIM, HIDDEN)
        qb, kb = rand(HEADS * HEAD_DIM), rand(KV_HEADS * HEAD_DIM)
        add(p + "attn_q.weight", hf + "self_attn.q_proj.weight", q, _llama_permute(q, HEADS))
        add(p + "attn_k.weight", hf + "self_attn.k_proj.weight", k, _llama_permute(k, KV_HEADS))
        add(p + "attn_v.weight", hf + "self_attn.v_proj.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN))
        add(p + "attn_q.bias", hf + "self_attn.q_proj.bias", qb, _llama_permute(qb, HEADS))
        add(p + "attn_k.bias", hf + "self_attn.k_proj.bias", kb, _llama_permute(kb, KV_HEADS))
        add(p + "attn_v.bias", hf + "self_attn.v_proj.bias", rand(KV_HEADS * HEAD_DIM))
        add(p + "attn_output.weight", hf + "self_attn.o_proj.weight", rand(HIDDEN, HEADS * HEAD_DIM))
        add(p + "ffn_gate.weight", hf + "mlp.gate_proj.weight", rand(FFN, HIDDEN))
        add(p + "ffn_up.weight", hf + "mlp.up_proj.weight", rand(FFN, HIDDEN))
        add(p + "ffn_down.weight", hf + "mlp.down_proj.weight", rand(HIDDEN, FFN), q8=True)
        add(p + "attn_norm.weight", hf + "input_layernorm.weight", norm())
        add(p + "post_attention_norm.weight", hf + "post_attention_layernorm.weight", norm())
    add("output_norm.weight", "model.norm.weight", norm())
    add("output.weight", "lm_head.weight", rand(vocab, HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def _hf_config(vocab_size: int, config_cls=KvTestConfig) -> transformers.PretrainedConfig:
    return config_cls(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, attention_bias=config_cls is transformers.LlamaConfig,
    )


def _greedy(model: str, cache_dir: Path, prompts: list[list[int]], max_tokens: int):
    llm = LLM(model, dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16,
              max_num_seqs=4, model_cache_dir=str(cache_dir), seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, torch.tensor(logprobs)


@pytest.fixture(scope="module")
def kvtest(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("kvtest") / "kvtest-tiny.gguf"
    return path, _write(path)


PROMPTS = [[256, 257, 72, 101, 108], [3, 141, 59, 26, 53, 58, 97, 93, 23, 84]]


def test_gguf_of_a_registered_architecture_runs_as_its_float_weights(kvtest, tmp_path: Path) -> None:
    path, weights = kvtest
    vocab = weights["model.embed_tokens.weight"].shape[0]
    assert arch_spec("kvtest_llama").gguf_arch == "kvtest"
    # The same weights as a float HF folder of the new model_type.
    folder = tmp_path / "float"
    _hf_config(vocab).save_pretrained(folder)
    save_file(weights, str(folder / "model.safetensors"))

    gguf_tokens, gguf_logprobs = _greedy(str(path), tmp_path / "cache", PROMPTS, 12)
    float_tokens, float_logprobs = _greedy(str(folder), tmp_path / "cache", PROMPTS, 12)
    assert gguf_tokens == float_tokens
    torch.testing.assert_close(gguf_logprobs, float_logprobs, rtol=0, atol=1e-5)

    # transformers' Llama with the same weights (its o_proj bias, which the architecture
    # lacks, zero) decodes the same tokens.
    hf = transformers.LlamaForCausalLM(_hf_config(vocab, transformers.LlamaConfig)).eval()
    state = {**weights, **{f"model.layers.{i}.self_attn.o_proj.bias": torch.zeros(HIDDEN) for i in range(LAYERS)}}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    for prompt, ours in zip(PROMPTS, gguf_tokens):
        want, margins = hf_greedy(hf, prompt, 12)
        assert ours == want, f"margins {margins}"


def test_registration_refuses_a_class_without_its_own_spec() -> None:
    class Unspecified(LlamaForCausalLM):  # inherits Llama's specs: would take over "llama"
        pass

    with pytest.raises(ValueError, match="model_type 'llama' is already registered"):
        register_model(Unspecified)

    class NoSpecs(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="declares no arch_specs"):
        register_model(NoSpecs)
