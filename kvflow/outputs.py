"""User-facing results of generation (the shapes vLLM users know)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow.logprobs import Logprob
from kvflow.sampling_params import RequestOutputKind  # (defined there, as vLLM's; re-exported)


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: position among the request's outputs (0 when n == 1).
        text: detokenized output text (cumulative, or the new text for a DELTA request).
        token_ids: generated token ids (cumulative, or the new ones for a DELTA request).
        finish_reason: "stop", "length", "abort", "error" (see ``RequestOutput.error``), or
            None while still generating.
        stop_reason: the stop string or stop token id that ended the output (None for EOS,
            length or abort).
        logprobs: when requested, one {token id: ``Logprob``} per generated token (new tokens
            only for a DELTA request; the
            sampled token and the top ``logprobs``; a ``Logprob`` is a float with ``.logprob``,
            ``.rank`` and ``.decoded_token``, as vLLM's).
        cumulative_logprob: sum of the sampled tokens' log-probabilities, when requested.
        lora_request: the ``LoRARequest`` the request ran with (None: the base model), as
            vLLM's.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    lora_request: Any = None

    def finished(self) -> bool:
        """Whether this output has ended (it has a finish reason), as vLLM's."""
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestFailure:
    """Why the engine failed one request while it went on serving the others.

    Attributes:
        message: ``"ExceptionType: text"`` of the fault.
        is_invalid_request: True when the request itself is at fault (a ``ValueError``
            raised while preparing, running or sampling it; the server answers 400), False
            for an internal fault (500).
    """

    message: str
    is_invalid_request: bool = False

    @classmethod
    def from_exception(cls, exc: BaseException) -> "RequestFailure":
        return cls(f"{type(exc).__name__}: {exc}", isinstance(exc, ValueError))


@dataclass
class RequestMetrics:
    """Timings of one request in seconds on the monotonic clock (``time.monotonic``), vLLM's
    ``RequestMetrics`` fields; None until the event happened.

    Attributes:
        arrival_time: when the engine received the request.
        first_scheduled_time: when a step first computed any of its tokens.
        first_token_time: when its first output token was sampled.
        finished_time: when it finished.

    Read also as a mapping, as kvflow's earlier dict (``metrics["arrival_time"]``,
    ``metrics.get(...)``; a key is present once its time is set).
    """

    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival to first scheduling (vLLM's field)."""
        if self.first_scheduled_time is None or self.arrival_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def first_token_latency(self) -> float | None:
        """Seconds from arrival to the first output token (vLLM V1's ``first_token_latency``)."""
        if self.first_token_time is None or self.arrival_time is None:
            return None
        return self.first_token_time - self.arrival_time

    def keys(self) -> list[str]:
        return [k for k in ("arrival_time", "first_scheduled_time", "first_token_time", "finished_time")
                if getattr(self, k) is not None]

    def __getitem__(self, key: str) -> float:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def get(self, key: str, default: float | None = None) -> float | None:
        return self[key] if key in self else default


def _as_metrics(metrics: "RequestMetrics | dict[str, float | None] | None") -> RequestMetrics:
    if isinstance(metrics, RequestMetrics):
        return metrics
    return RequestMetrics(**(metrics or {}))


@dataclass
class RequestOutput:
    """Progress or result of one request.

    Attributes:
        request_id: the id the request was added with.
        prompt: the prompt text, or None when the request was given as token ids.
        prompt_token_ids: the prompt's token ids.
        outputs: one ``CompletionOutput`` per sample.
        finished: True once every output has a finish reason.
        metrics: a ``RequestMetrics`` (timings in seconds on the monotonic clock:
            arrival_time, first_scheduled_time, first_token_time, finished_time); a dict of
            those is converted.
        prompt_logprobs: when requested, one entry per prompt token, as vLLM: None for the
            first (nothing predicts it), then {token id: ``Logprob``} holding the actual
            token and the top ``prompt_logprobs``. As vLLM's: set from the first output
            after the prompt's last chunk is computed (its first token's) on, on every
            CUMULATIVE output, on the first DELTA output only (None on the others; given
            again, once, if a recomputation after a preemption changed the values, which
            CUMULATIVE and FINAL_ONLY outputs then carry).
        error: set (with ``finished`` True and every finish_reason "error") when the engine
            failed this request; its blocks are freed and the other requests go on.
        num_cached_tokens: prompt tokens that were prefix-cache hits when the request was
            first scheduled (vLLM's field; 0 before that).
        lora_request: the ``LoRARequest`` the request ran with (None: the base model), as
            vLLM's.
        encoder_prompt, encoder_prompt_token_ids: vLLM's, for encoder-decoder models; always
            None (kvflow runs decoder-only models).
        kv_transfer_params: vLLM's, from a KV connector; always None (kvflow has no KV
            transfer).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: RequestFailure | None = None
    num_cached_tokens: int = 0
    lora_request: Any = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if type(self.metrics) is not RequestMetrics:  # (the engine's outputs come with one)
            self.metrics = _as_metrics(self.metrics)


@dataclass
class BeamSearchSequence:
    """One finished beam.

    Attributes:
        token_ids: prompt followed by the generated tokens.
        text: detokenized generated text.
        cumulative_logprob: sum of the generated tokens' log-probabilities.
        score: ``cumulative_logprob / num_generated ** length_penalty`` (ranking key).
        finish_reason: "stop" (EOS) or "length".
    """

    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float
    finish_reason: str

    @property
    def tokens(self) -> list[int]:
        """vLLM's name of ``token_ids`` (prompt and generated ids)."""
        return self.token_ids

    @property
    def cum_logprob(self) -> float:
        """vLLM's name of ``cumulative_logprob``."""
        return self.cumulative_logprob


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class EmbeddingOutput:
    """The vector of one embedding request (vLLM's ``EmbeddingOutput``).

    Attributes:
        embedding: the pooled final hidden state (``kvflow.pooling_params``), L2-normalized
            unless the request said otherwise; ``hidden_size`` floats (float32 values).
    """

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """Result of one embedding request (vLLM's ``EmbeddingRequestOutput``).

    Attributes:
        request_id: the id the request was added with.
        outputs: its ``EmbeddingOutput`` (an empty vector when ``error`` is set).
        prompt_token_ids: the prompt's token ids.
        num_cached_tokens: prompt tokens that were prefix-cache hits (always 0 for mean
            pooling, which computes every token).
        finished: True (an embedding is reported once, when its prompt is computed).
        prompt: the prompt text, or None when it was given as token ids.
        metrics: as ``RequestOutput.metrics`` (arrival_time, first_scheduled_time,
            finished_time).
        error: set when the engine failed this request (see ``RequestOutput.error``).
    """

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool
    prompt: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: RequestFailure | None = None

    def __post_init__(self) -> None:
        self.metrics = _as_metrics(self.metrics)
