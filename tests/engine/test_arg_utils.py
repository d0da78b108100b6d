"""``kvflow.engine.arg_utils.EngineArgs``: how a requested quantization meets a saved
quantized checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from kvflow.engine.arg_utils import EngineArgs


@pytest.fixture
def saved_int8(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "kvflow_quantization": {"method": "int8", "group_size": 32}}))
    return tmp_path


@pytest.mark.parametrize("requested", [None, "int8"])
def test_a_saved_checkpoint_loads_as_saved(saved_int8, requested):
    args = EngineArgs(model=str(saved_int8), quantization=requested)
    assert args.resolved_quantization(requested, saved_int8, torch.device("cpu")) == requested


@pytest.mark.parametrize("requested", ["int4", "int4-rtn", "fp8", "gguf", "none"])
def test_another_scheme_than_the_saved_one_is_refused_by_name(saved_int8, requested):
    """LLM("smollm2-int8", quantization="int4") loaded the INT8 weights and said nothing."""
    args = EngineArgs(model=str(saved_int8), quantization=requested)
    with pytest.raises(ValueError, match=rf"^quantization='{requested}': .* saved quantized with 'int8'"):
        args.resolved_quantization(requested, saved_int8, torch.device("cpu"))


def test_int4_rtn_is_the_saved_int4(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"kvflow_quantization": {"method": "int4", "group_size": 32}}))
    args = EngineArgs(model=str(tmp_path))
    assert args.resolved_quantization("int4-rtn", tmp_path, torch.device("cpu")) == "int4-rtn"


@pytest.mark.parametrize("field,value,bound", [("max_loras", 10**6, 256), ("max_lora_rank", 4096, 512),
                                               ("max_cpu_loras", 10**7, 4096)])
def test_lora_sizes_have_a_bound_named_in_the_error(field, value, bound):
    """max_lora_rank=4096 or max_loras=10**6 failed in the allocator with a bare RuntimeError."""
    with pytest.raises(ValueError, match=rf"^{field} must be at most {bound}, got {value}$"):
        EngineArgs(model="smollm2-135m", enable_lora=True, **{field: value}).verify()
    EngineArgs(model="smollm2-135m", enable_lora=True, **{field: bound}).verify()  # the bound itself is taken
