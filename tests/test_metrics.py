"""The server's Prometheus metrics (kvflow/metrics.py) fed from a real engine's stats."""

from __future__ import annotations

import torch
from prometheus_client import generate_latest

from conftest import make_engine, run_to_completion, tiny_model, tiny_model_config
from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.metrics import EngineMetrics
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.ngram import NgramProposer


def _value(metrics: EngineMetrics, name: str) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_speculative_counters_follow_the_engine_and_stay_zero_without_a_proposer():
    config = tiny_model_config(vocab_size=32)
    engine = make_engine(tiny_model(config), config, CacheConfig(4, 64, torch.float32), SchedulerConfig(64, 16, 256),
                         proposer=NgramProposer(3, 1, 3, 256))  # fmt: skip
    metrics = EngineMetrics("tiny")
    engine.add_request("rep", [1, 2, 3] * 6, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        metrics.update_engine_stats(engine.get_stats())
    stats = engine.get_stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert _value(metrics, "kvflow:spec_decode_num_draft_tokens_total") == stats["spec_num_draft_tokens"]
    assert _value(metrics, "kvflow:spec_decode_num_accepted_tokens_total") == stats["spec_num_accepted_tokens"]

    plain = make_engine(tiny_model(config), config, CacheConfig(4, 64, torch.float32), SchedulerConfig(64, 16, 256))
    metrics = EngineMetrics("tiny")
    plain.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    run_to_completion(plain)
    metrics.update_engine_stats(plain.get_stats())
    assert _value(metrics, "kvflow:spec_decode_num_draft_tokens_total") == 0
    assert _value(metrics, "kvflow:spec_decode_num_accepted_tokens_total") == 0


def test_window_freed_blocks_counter_follows_the_engine():
    """A Mistral-style tiny model (every layer windowed, 8 tokens, blocks of 4): the blocks the
    window frees reach ``kvflow:kv_window_freed_blocks_total``."""
    import transformers

    hf = transformers.MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                    max_position_embeddings=256)
    config = tiny_model_config(vocab_size=32)
    config = type(config)(**{**config.__dict__, "model_type": "mistral", "hf_config": hf})
    engine = make_engine(tiny_model(config), config, CacheConfig(4, 64, torch.float32), SchedulerConfig(64, 16, 256))
    metrics = EngineMetrics("tiny")
    engine.add_request("a", list(range(20)), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        metrics.update_engine_stats(engine.get_stats())
    freed = engine.get_stats()["num_window_freed_blocks"]
    assert freed > 0 and _value(metrics, "kvflow:kv_window_freed_blocks_total") == freed


def test_thread_governor_gauges_and_changes_counter():
    """The governor's stats reach ``kvflow:cpu_threads``, ``kvflow:cpu_other_load`` and
    ``kvflow:cpu_thread_changes_total`` (the counter advances by the stats' deltas only)."""
    metrics = EngineMetrics("tiny")
    base = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
    metrics.update_engine_stats({**base, "num_cpu_threads": 1, "cpu_other_load": 0.8, "num_cpu_thread_changes": 1})
    metrics.update_engine_stats({**base, "num_cpu_threads": 2, "cpu_other_load": 0.1, "num_cpu_thread_changes": 3})
    assert _value(metrics, "kvflow:cpu_threads") == 2
    assert _value(metrics, "kvflow:cpu_other_load") == 0.1
    assert _value(metrics, "kvflow:cpu_thread_changes_total") == 3
    metrics.update_engine_stats({**base, "num_cpu_threads": 2, "cpu_other_load": 0.0, "num_cpu_thread_changes": 3})
    assert _value(metrics, "kvflow:cpu_thread_changes_total") == 3
