"""Per-request parameters of an embedding (pooling) request, in vLLM's shape.

An embedding request runs the decoder over its prompt (scheduled like any prompt, chunked
prefill included), never samples, and finishes when its prompt is computed. Its vector is
pooled from the final hidden states (after the last RMSNorm, the states the LM head reads):

- ``last``: the hidden state of the prompt's last token (what a causal decoder has seen all
  of the prompt at; vLLM's default for generative models run as embedders, e.g.
  E5-Mistral, Wang et al. 2024, "Improving Text Embeddings with Large Language Models",
  section 3.1).
- ``mean``: the mean over every prompt token's hidden state (vLLM's ``MEAN`` pooler). Every
  token must be computed, so such a request takes no prefix-cache hits; the runner sums each
  chunk's states as they are computed.

The vector is then L2-normalized unless ``normalize`` (vLLM 0.32's ``use_activation``) is
False.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvflow.sampling_params import check_truncate_prompt_tokens

POOLING_TYPES = ("last", "mean")


@dataclass
class PoolingParams:
    """How to turn one prompt's hidden states into an embedding.

    Attributes:
        pooling_type: "last" or "mean" (case-insensitive, so vLLM's "LAST" / "MEAN" work);
            None: the engine's default (``EngineArgs.pooling``, ``--pooling``).
        normalize: L2-normalize the pooled vector (default True).
        use_activation: vLLM 0.32's name for ``normalize`` (for embeddings its "activation"
            is the normalization); give one of the two, or both equal.
        dimensions: the output size. Only the model's hidden size is accepted (no
            matryoshka truncation, which vLLM too allows only for models trained for it);
            None: the hidden size.
        task: vLLM's pooling task; kvflow has "embed" only (None means it).
        truncate_prompt_tokens: vLLM's: embed only the prompt's last k tokens; -1: as many
            as ``max_model_len``; None: the whole prompt (``LLMEngine.truncate_prompt``).

    Raises:
        ValueError: naming the field, for a value outside the above (``dimensions`` is
            checked against the model by ``LLMEngine``).
    """

    pooling_type: str | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    dimensions: int | None = None
    task: str | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.lower() not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)} (decoder models: no cls "
                                 f"pooling), got {self.pooling_type!r}")
            self.pooling_type = self.pooling_type.lower()
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true, false or None, got {value!r}")
        if self.normalize is not None and self.use_activation is not None and self.normalize != self.use_activation:
            raise ValueError(f"normalize ({self.normalize}) and use_activation ({self.use_activation}) are the same "
                             "option for embeddings and disagree; give one")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.task not in (None, "embed"):
            raise ValueError(f"task must be 'embed' (kvflow's only pooling task), got {self.task!r}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)

    @property
    def l2_normalize(self) -> bool:
        """Whether the vector is L2-normalized (``normalize``, else ``use_activation``, else True)."""
        for value in (self.normalize, self.use_activation):
            if value is not None:
                return value
        return True

    @property
    def needs_every_position(self) -> bool:
        """Mean pooling reads every prompt token's hidden state (no prefix-cache hits)."""
        return self.pooling_type == "mean"

    def resolved(self, default_pooling: str) -> "PoolingParams":
        """A copy with ``pooling_type`` set (``default_pooling`` when unset)."""
        return replace(self, pooling_type=self.pooling_type or default_pooling)
