"""kvflow against llama.cpp on the same GGUF file (opt-in: needs ``llama-cpp-python``,
``pip install llama-cpp-python``, which is not in the test extra).

Both engines score one prompt (the same token ids); the prompt logprobs kvflow reports
(``prompt_logprobs``) are compared with ``log_softmax`` of llama.cpp's logits at every
position. Measured on SmolLM2-135M Q4_1 (44 tokens, 2026-12-02, AMD EPYC Zen 4): computed as
stored, top-1 equal at 40/43 positions, |logprob difference| of the actual next token mean
0.083, max 0.43; dequantized to float32, 43/43, mean 0.052, max 0.28. Both sides round the
activations to int8 per 32-element block when computed as stored (llama.cpp's Q8_1 /
Q8_0 activation blocks; ``kvflow.layers.gguf_kernels``) — independently, hence the wider gap.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from tests.conftest import requires_smollm2

llama_cpp = pytest.importorskip("llama_cpp", reason="opt-in: pip install llama-cpp-python")

TEXT = ("The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers that changed "
        "physics: on the photoelectric effect, Brownian motion, special relativity and mass-energy equivalence.")


@pytest.fixture(scope="module")
def llamacpp_logprobs():
    from kvflow.model import packages

    path = packages.locate_parts(packages.lookup("smollm2-135m"))[0]
    model = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=512, n_threads=2, verbose=False)
    ids = model.tokenize(TEXT.encode(), add_bos=False)
    model.eval(ids)
    scores = torch.tensor(np.array(model.scores[: len(ids)]), dtype=torch.float64)
    del model
    return ids, torch.log_softmax(scores, -1)


@requires_smollm2
@pytest.mark.parametrize("kwargs, min_agree, max_mean", [
    ({}, 0.85, 0.15),  # computed as stored (the CPU default)
    ({"quantization": "none", "dtype": "float32"}, 0.95, 0.1),  # the same blocks dequantized
], ids=["as-stored", "dequantized-float32"])
def test_prompt_logprobs_match_llamacpp_on_the_same_file(llamacpp_logprobs, kwargs, min_agree, max_mean):
    ids, ref = llamacpp_logprobs
    assert len(ids) > 30
    llm = LLM(model="smollm2-135m", max_model_len=512, **kwargs)
    if not kwargs:
        assert llm.llm_engine.config.load.quantization == "gguf"
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=5, temperature=0))
    plp = out[0].prompt_logprobs
    agree, diffs = 0, []
    for i in range(1, len(ids)):
        best = min(plp[i].items(), key=lambda kv: kv[1].rank)[0]
        agree += int(best == int(ref[i - 1].argmax()))
        diffs.append(abs(plp[i][ids[i]].logprob - float(ref[i - 1, ids[i]])))
    n = len(ids) - 1
    assert agree >= min_agree * n, (agree, n)
    assert sum(diffs) / n < max_mean and max(diffs) < 1.0, (sum(diffs) / n, max(diffs))
