"""``kvflow.AsyncLLMEngine`` / ``AsyncEngineArgs``: vLLM's asyncio engine (``AsyncLLM``), as
its examples/offline_inference/async_llm_streaming.py uses it, on a tiny random model."""

from __future__ import annotations

import asyncio

import pytest

from conftest import tiny_hf_model_dir
from kvflow import LLM, SamplingParams
from kvflow.sampling_params import RequestOutputKind

pytestmark = pytest.mark.usefixtures("one_thread")
OPTIONS = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_hf_model_dir(tmp_path_factory.mktemp("async-llm")))


def test_vllms_async_llm_streams_as_llm_generates(model_dir):
    """``from kvflow import AsyncEngineArgs, AsyncLLMEngine`` (vLLM's top-level names) and
    ``kvflow.engine.arg_utils.AsyncEngineArgs``; DELTA outputs add up to ``LLM.generate``'s
    text, concurrent requests get their own tokens, CUMULATIVE / FINAL_ONLY as vLLM's, and a
    refused request raises ValueError naming the field. Each import was an ImportError."""
    from kvflow import AsyncEngineArgs, AsyncLLMEngine
    from kvflow.engine.arg_utils import AsyncEngineArgs as FromArgUtils

    assert FromArgUtils is AsyncEngineArgs
    prompts = ["ab cd", "hello there", "xyz"]
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].text for o in LLM(model_dir, **OPTIONS).generate(prompts, SamplingParams(**greedy),
                                                                              use_tqdm=False)]

    async def run():
        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model_dir, **OPTIONS))
        try:
            async def stream(prompt, request_id, kind):
                params = SamplingParams(**greedy, output_kind=kind)
                outs = [o async for o in engine.generate(prompt=prompt, sampling_params=params, request_id=request_id)]
                assert outs[-1].finished and not any(o.finished for o in outs[:-1])
                return outs

            deltas = await asyncio.gather(*[stream(p, f"d{i}", RequestOutputKind.DELTA) for i, p in enumerate(prompts)])
            assert ["".join(o.outputs[0].text for o in outs) for outs in deltas] == expected
            assert all(len(outs) > 1 for outs in deltas)  # streamed, not one final output
            (final,) = await stream(prompts[0], "f", RequestOutputKind.FINAL_ONLY)
            assert final.outputs[0].text == expected[0]
            cumulative = await stream(prompts[1], "c", RequestOutputKind.CUMULATIVE)
            assert cumulative[-1].outputs[0].text == expected[1]
            with pytest.raises(ValueError, match="tokenization_kwargs is not supported by kvflow"):
                async for _ in engine.generate("x", SamplingParams(), "t", tokenization_kwargs={"a": 1}):
                    pass
            with pytest.raises(ValueError, match="prompt must not be empty"):
                async for _ in engine.generate("", SamplingParams(), "e"):
                    pass
            # leaving the iterator early aborts the request; its id is free again
            async for _ in engine.generate(prompts[0], SamplingParams(**greedy), "early"):
                break
            await asyncio.sleep(0.05)
            (again,) = [o async for o in engine.generate(prompts[0], SamplingParams(**greedy, output_kind=RequestOutputKind.FINAL_ONLY), "early")]
            assert again.outputs[0].text == expected[0]
            assert (await engine.get_tokenizer()) is not None and engine.is_running and not engine.errored
        finally:
            engine.shutdown()

    asyncio.run(run())
