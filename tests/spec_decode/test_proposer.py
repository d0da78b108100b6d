"""``build_proposer``: the one choice of a speculative proposer from the engine's config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_model_config
from kvflow.config import CacheConfig, DeviceConfig, EngineConfig, LoadConfig, SchedulerConfig, SpeculativeConfig
from kvflow.spec_decode.draft_model import DraftModelProposer
from kvflow.spec_decode.ngram import NgramProposer
from kvflow.spec_decode.proposer import build_proposer

CPU = torch.device("cpu")


def _config(spec: SpeculativeConfig | None) -> EngineConfig:
    return EngineConfig(tiny_model_config(), CacheConfig(4, 16, torch.float32), SchedulerConfig(64, 4, 64),
                        device=DeviceConfig(CPU, torch.float32), speculative=spec)


def test_ngram_method_builds_a_lookup_proposer_with_the_configs_sizes():
    proposer = build_proposer(_config(SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=4)))
    assert isinstance(proposer, NgramProposer)
    assert (proposer.k, proposer.n_min, proposer.n_max, proposer.max_model_len) == (3, 1, 4, 64)


def test_draft_model_method_drives_the_runner_it_is_handed_over_the_drafts_pool():
    config = _config(SpeculativeConfig("draft_model", 2, model="d")).with_draft(
        tiny_model_config(num_hidden_layers=1), LoadConfig("d", "/nowhere", None, 32))
    runner = SimpleNamespace(sampler=SimpleNamespace(generator=torch.Generator()))
    proposer = build_proposer(config, runner)
    assert isinstance(proposer, DraftModelProposer)
    assert proposer.runner is runner and proposer.k == 2 and proposer.max_model_len == 64
    assert proposer.vocab_size == config.draft.model.vocab_size
    assert proposer.kv.block_pool.num_blocks == config.draft.cache.num_blocks


def test_draft_model_method_without_its_runner_or_config_and_no_method_are_refused():
    spec = SpeculativeConfig("draft_model", 2, model="d")
    with pytest.raises(ValueError, match="draft"):
        build_proposer(_config(spec), SimpleNamespace())  # no config.draft
    with_draft = _config(spec).with_draft(tiny_model_config(num_hidden_layers=1), LoadConfig("d", "/nowhere", None, 32))
    with pytest.raises(ValueError, match="runner"):
        build_proposer(with_draft)
    with pytest.raises(ValueError, match="speculative"):
        build_proposer(_config(None))
