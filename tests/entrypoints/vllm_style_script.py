"""A script written for vLLM's offline API, run on kvflow by switching one import.

``run(model_dir, api)`` uses only what ``vllm.LLM`` offers (vLLM 0.32's keywords, prompt
dicts, ``SamplingParams``, ``RequestOutput`` / ``Logprob`` / ``EmbeddingRequestOutput``
fields), asserts the shapes vLLM documents and returns a JSON-able summary (token ids,
texts, logprobs, embeddings) so that two runs can be compared.

- CI: ``tests/entrypoints/test_vllm_compat.py`` runs it on kvflow (``api="kvflow"``).
- By hand against a real vLLM (its own environment; vLLM's CPU build needs a block size
  that is a multiple of 32, hence 32 here, and takes minutes to start)::

      VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=1 \\
        <vllm-venv>/bin/python tests/entrypoints/vllm_style_script.py MODEL_DIR vllm out.json

  then compare out.json with ``python tests/entrypoints/vllm_style_script.py MODEL_DIR
  kvflow out-kvflow.json``.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]


def _import(api: str):
    if api == "vllm":
        from vllm import LLM, SamplingParams  # the one line a user changes
    else:
        from kvflow import LLM, SamplingParams
    return LLM, SamplingParams


def _logprobs(entries) -> list[dict[str, Any]]:
    """Per position: the entries as {token id: [logprob, rank, decoded_token]}."""
    return [{str(t): [lp.logprob, lp.rank, lp.decoded_token] for t, lp in entry.items()} for entry in entries]


def run(model_dir: str, api: str = "kvflow") -> dict[str, Any]:
    LLM, SamplingParams = _import(api)
    llm = LLM(
        model=model_dir, tokenizer=model_dir, dtype="float32", seed=0, max_model_len=512, block_size=32,
        enable_prefix_caching=True, max_num_seqs=8, max_num_batched_tokens=64, enforce_eager=True,
        trust_remote_code=False, tensor_parallel_size=1, gpu_memory_utilization=0.9,
        kv_cache_memory_bytes=64 * 2**20, disable_log_stats=True, tokenizer_mode="auto",
        scheduling_policy="priority",
    )  # fmt: skip
    out: dict[str, Any] = {}
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT)

    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    results = llm.generate([PROMPT, {"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert len(results) == 2
    for r in results:
        c = r.outputs[0]
        assert isinstance(r.request_id, str) and r.prompt_token_ids == ids and r.finished
        assert len(c.token_ids) == 6 and c.finish_reason == "length" and isinstance(c.text, str)
        assert len(c.logprobs) == 6 and all(c.token_ids[i] in c.logprobs[i] for i in range(6))
        assert all(2 <= len(e) <= 3 for e in c.logprobs)
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(ids)
        assert math.isclose(c.cumulative_logprob, sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids)),
                            abs_tol=1e-4)
    assert results[0].prompt == PROMPT
    assert results[1].outputs[0].token_ids == results[0].outputs[0].token_ids
    first = results[0].outputs[0]
    out["greedy_token_ids"] = list(first.token_ids)
    out["greedy_text"] = first.text
    out["logprobs"] = _logprobs(first.logprobs)
    out["prompt_logprobs"] = [None] + _logprobs(results[0].prompt_logprobs[1:])

    sampled = llm.generate(PROMPT, SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=7, max_tokens=5),
                           use_tqdm=False)
    assert len(sampled) == 1 and len(sampled[0].outputs) == 2
    assert {c.index for c in sampled[0].outputs} == {0, 1}

    stopped = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=30, stop=["."]), use_tqdm=False)
    s = stopped[0].outputs[0]
    assert s.finish_reason in ("stop", "length") and "." not in s.text
    out["stop_text"], out["stop_reason"] = s.text, s.stop_reason

    chat = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False,
                    add_generation_prompt=True, chat_template_kwargs=None)
    assert len(chat) == 1
    out["chat_prompt_token_ids"] = list(chat[0].prompt_token_ids)
    out["chat_text"] = chat[0].outputs[0].text
    both = llm.chat([MESSAGES, MESSAGES[1:]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert len(both) == 2
    cont = llm.chat([*MESSAGES, {"role": "assistant", "content": "Blue is"}],
                    SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False,
                    add_generation_prompt=False, continue_final_message=True)
    out["continue_prompt_tail"] = tok.decode(cont[0].prompt_token_ids[-3:])

    prio = llm.generate([PROMPT, PROMPT + " a"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False,
                        priority=[1, 0])
    assert [len(r.outputs[0].token_ids) for r in prio] == [3, 3]
    assert llm.reset_prefix_cache() is True
    again = llm.generate(PROMPT, greedy, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.token_ids
    out["num_cached_tokens_after_reset"] = again.num_cached_tokens
    del llm

    if api == "vllm":
        import gc

        gc.collect()
    embedder = LLM(model=model_dir, runner="pooling", dtype="float32", seed=0, max_model_len=512,
                   enforce_eager=True, kv_cache_memory_bytes=64 * 2**20)  # fmt: skip
    vectors = embedder.embed(["hello world", PROMPT], use_tqdm=False)
    assert len(vectors) == 2
    for v in vectors:
        e = v.outputs.embedding
        assert isinstance(e, list) and len(e) > 0
        assert math.isclose(math.sqrt(sum(x * x for x in e)), 1.0, abs_tol=1e-4)
        assert v.prompt_token_ids
    out["embedding_dim"] = len(vectors[0].outputs.embedding)
    out["embeddings_head"] = [v.outputs.embedding[:4] for v in vectors]
    return out


if __name__ == "__main__":
    model_dir, api = sys.argv[1], sys.argv[2]
    summary = run(model_dir, api)
    text = json.dumps(summary, indent=1)
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as f:
            f.write(text)
    print(text)
