"""The one choice of a speculative proposer: the method ``SpeculativeConfig.method`` names.

"ngram" looks drafts up in the request's own tokens (``kvflow.spec_decode.ngram``); a
"draft_model" proposer drives the draft model's runner (``kvflow.spec_decode.draft_model``),
which the worker's builder makes from the draft's own ``EngineConfig`` (``config.draft``)
before calling this, and hands in built (this package stands below the worker's). A new
method is one file here and one branch below.
"""

from __future__ import annotations

from typing import Any

from kvflow.config import EngineConfig
from kvflow.spec_decode.draft_model import DraftModelProposer
from kvflow.spec_decode.ngram import NgramProposer


def build_proposer(config: EngineConfig, draft_runner: Any = None) -> NgramProposer | DraftModelProposer:
    """The proposer ``config.speculative`` names, proposing up to
    ``num_speculative_tokens`` tokens per request within ``config.scheduler.max_model_len``
    (and, for "draft_model", within the draft's context: a request longer than the draft can
    run gets no drafts, plain decoding, as vLLM's).

    Args:
        config: the target's ``EngineConfig`` (``speculative`` set; for "draft_model" also
            ``draft``, the draft's own config: its vocabulary and its KV block pool).
        draft_runner: the draft model's ``ModelRunner`` (``kvflow.worker.model_runner``;
            duck-typed), built from ``config.draft``; needed for "draft_model" only.

    Raises:
        ValueError: no speculative method configured, an invalid n-gram range, or a
            "draft_model" method without its draft config or runner.
    """
    spec, max_len = config.speculative, config.scheduler.max_model_len
    if spec is None:
        raise ValueError("build_proposer needs config.speculative")
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        return NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max, max_len)
    draft = config.draft
    if draft is None or draft_runner is None:
        raise ValueError("a draft_model proposer needs the draft's config (EngineArgs.create_config resolves it) "
                         "and its runner")
    return DraftModelProposer(draft_runner, draft.model.vocab_size, draft.cache, k,
                              min(max_len, draft.model.context_len))
