"""kvflow on Ray Serve (``kvflow.entrypoints.ray_serve``; ``pip install 'kvflow[ray]'``).

The end-to-end test starts a local Ray cluster on 127.0.0.1 and two replicas of a tiny model
behind ``PrefixCacheAffinityRouter``; it is opt-in (``KVFLOW_TEST_RAY=1``): Ray's start-up
alone takes 20-60 s on 2 busy cores. The request-parsing and argument checks run whenever
Ray is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest

pytest.importorskip("ray.serve", reason="pip install 'kvflow[ray]' (ray[serve])")

from conftest import tiny_hf_model_dir  # noqa: E402
from kvflow.entrypoints.ray_serve import OpenAIRequest, build_openai_app  # noqa: E402


def test_request_exposes_what_the_prefix_router_reads():
    chat = OpenAIRequest("POST", "/v1/chat/completions",
                         json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), {})
    assert chat.messages == [{"role": "user", "content": "hi"}] and not hasattr(chat, "prompt")
    anthropic = OpenAIRequest("POST", "/v1/messages", json.dumps({"system": "be brief", "messages": []}).encode(), {})
    assert anthropic.messages == [{"content": "be brief"}]
    assert OpenAIRequest("POST", "/v1/completions", b'{"prompt": "abc"}', {}).prompt == "abc"
    assert OpenAIRequest("POST", "/v1/responses", b'{"input": "xyz"}', {}).prompt == "xyz"
    assert OpenAIRequest("POST", "/v1/completions", b"not json", {}).prompt == "/v1/completions"
    assert OpenAIRequest("GET", "/v1/models", b"", {}).prompt == "/v1/models"  # never empty


def test_replica_bounds_are_checked():
    with pytest.raises(ValueError, match="min_replicas"):
        build_openai_app({"model": "x"}, min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="num_replicas"):
        build_openai_app({"model": "x"}, num_replicas=0)


@pytest.mark.skipif(os.environ.get("KVFLOW_TEST_RAY") != "1", reason="opt-in: KVFLOW_TEST_RAY=1 (Ray's start-up is slow)")
def test_two_replicas_on_a_local_ray_cluster(tmp_path):
    import openai
    import ray
    from ray import serve

    from kvflow.entrypoints.data_parallel import free_port

    model = tiny_hf_model_dir(tmp_path / "tiny")
    port = free_port()
    t0 = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"KVFLOW_CPU_KERNELS": "0"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_openai_app({"model": str(model), "num_threads": 1, "block_size": 4, "dtype": "float32"},
                               num_replicas=2, num_cpus_per_replica=0.5)
        serve.run(app, route_prefix="/")
        startup_s = time.monotonic() - t0
        print(f"Ray start-up + 2 replicas: {startup_s:.1f} s")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
        name = client.models.list().data[0].id
        # the multi-tenant workload, small: 4 tenants' system prompts, 3 rounds, interleaved
        tenants = ["".join(hashlib.sha256(f"{t}-{i}".encode()).hexdigest() for i in range(3)) for t in range(4)]
        cached = []
        for rnd in range(3):
            for system in tenants:
                r = client.chat.completions.create(model=name, max_tokens=2, messages=[
                    {"role": "system", "content": system}, {"role": "user", "content": f"question {rnd}"}])
                assert r.choices[0].finish_reason == "length"
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
        # the prefix router sent each tenant back to the replica holding its system prompt
        assert all(c >= len(tenants[0]) - 16 for c in cached[4:]), cached
        for _ in range(2):  # a raw prompt (no chat template): cached the second time, streamed
            chunks = list(client.completions.create(model=name, prompt=tenants[1] + "stream", max_tokens=4,
                                                    stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        bad = client.with_options(max_retries=0).completions
        with pytest.raises(openai.BadRequestError):  # kvflow's own 400, relayed
            bad.create(model=name, prompt="x", max_tokens=-1)
    finally:
        serve.shutdown()
        ray.shutdown()
