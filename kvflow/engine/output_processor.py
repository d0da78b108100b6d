"""From the engine core's token ids to ``RequestOutput``s (vLLM v1's ``OutputProcessor``).

The core (``kvflow/engine/core.py``) answers each step with, per sample, the new token ids,
their logprobs and a token-level finish reason. This module owns everything textual:

- incremental detokenization (``IncrementalDetokenizer``) and stop strings: each new token
  is fed on its own, so a stop string ends the sample at the token that completed it; the
  hit goes back to the core as a ``StopHit`` ("keep k output tokens") and the core ends the
  request before it schedules again (vLLM's output processor reports its stop-string hits
  the same way, as requests to abort);
- logprob decoding (``Logprob.decoded_token``, ``tokenizer.decode([id])`` cached by id) and
  ``cumulative_logprob``, summed as tokens arrive;
- prompt logprobs, gathered position by position as the prompt's chunks are computed and
  given from the first output after its last chunk (its first token's) on, as vLLM's;
- ``RequestOutput`` making, in one of vLLM's ``RequestOutputKind``s per request: CUMULATIVE
  (everything so far, each step), DELTA (only what is new since the previous output: the
  server's streams) or FINAL_ONLY (one output when the request finishes: ``LLM.generate``).

Per step, the work for a sample is proportional to its new tokens; only a CUMULATIVE output
copies the sample's token ids and logprobs so far (once per output, as vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvflow.core.scheduler import StopHit
from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.logprobs import Logprob
from kvflow.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestFailure,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams

# The kinds, read once: an enum member looked up on its class costs ~0.1 us in Python 3.11
# (a descriptor call), twice per request and step in ``_make_output``.
_DELTA, _FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@dataclass
class _SampleState:
    """Output state of one sample: its tokens, text, logprobs, and what was sent."""

    request_id: str  # the sample's id in the core
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # DELTA: tokens already sent
    num_sent_chars: int = 0   # DELTA: characters of the text already sent

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    """Output state of one user request (its ``n`` samples).

    Attributes:
        request_id: the user's id.
        prompt, prompt_token_ids: as given.
        params: its ``SamplingParams`` (or ``PoolingParams`` for an embedding request).
        output_kind: which ``RequestOutputKind`` its outputs take.
        samples: one ``_SampleState`` per sample, by index.
        arrival_time, first_scheduled_time, first_token_time: timings (``time.monotonic``).
        num_cached_tokens: prompt tokens that were prefix-cache hits at its first schedule.
        lora_request: the ``LoRARequest`` it runs with (None: the base model), given on
            its outputs.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    output_kind: RequestOutputKind
    samples: list[_SampleState]
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: dict[int, dict[int, Logprob]] = field(default_factory=dict)  # by position, as computed
    # the prompt's logprobs in vLLM's shape, made once from ``prompt_logprobs`` when all
    # positions are in (positions a preempted sample computes again after that are not taken)
    prompt_logprobs_list: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # DELTA: ``prompt_logprobs`` given on an output already
    embedding: list[float] | None = None
    lora_request: Any = None
    is_pooling: bool = field(init=False)  # an embedding request (``PoolingParams``)

    def __post_init__(self) -> None:
        self.is_pooling = isinstance(self.params, PoolingParams)

    @property
    def finished(self) -> bool:
        if self.is_pooling:
            return self.embedding is not None
        for sample in self.samples:
            if sample.finish_reason is None:
                return False
        return True


class OutputProcessor:
    """Turns ``EngineCoreOutputs`` into ``RequestOutput`` / ``EmbeddingRequestOutput``.

    Args:
        tokenizer: a transformers tokenizer, or None (token ids only: empty text, no
            ``decoded_token``; stop strings are refused earlier, at ``add_request``).
        eos_token_id: the engine's EOS: an output that stops on it (or on a
            ``stop_token_ids`` entry) does not have that token's text unless
            ``include_stop_str_in_output`` (vLLM's rule); its id stays in ``token_ids``.
    """

    def __init__(self, tokenizer: Any | None, eos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id  # (a stopping EOS is not text: _append)
        self.request_states: dict[str, RequestState] = {}  # by user request id
        self._sample_owner: dict[str, tuple[RequestState, _SampleState]] = {}  # by sample id
        self._token_texts: dict[int, str] = {}  # token id -> decode([id]), for Logprob.decoded_token
        # skip_special_tokens -> {token id: its text decoded alone}, the detokenizers' cache
        self._detok_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, sample_ids: list[str], prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams, arrival_time: float,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, lora_request: Any = None) -> None:
        """Track user request ``request_id`` whose samples run in the core as ``sample_ids``
        (``lora_request``: the adapter it runs with, given on its outputs). A request with
        ``detokenize=False`` has no text (and no ``decoded_token`` in its logprobs).

        Raises:
            ValueError: ``request_id`` already tracked; ``output_kind`` not a
                ``RequestOutputKind``.
        """
        if request_id in self.request_states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {output_kind!r}")
        samples = []
        for sample_id in sample_ids:
            detok = None
            if self.tokenizer is not None and isinstance(params, SamplingParams) and params.detokenize:
                skip = bool(params.skip_special_tokens)
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip, params.stop,
                                               params.include_stop_str_in_output, self._detok_texts[skip],
                                               params.min_tokens)
            samples.append(_SampleState(sample_id, detok))
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, output_kind, samples, arrival_time,
                             lora_request=lora_request)
        self.request_states[request_id] = state
        for sample in samples:
            self._sample_owner[sample.request_id] = (state, sample)

    def abort_request(self, request_id: str) -> RequestState | None:
        """Stop tracking ``request_id``; its state, or None when unknown."""
        state = self.request_states.pop(request_id, None)
        if state is not None:
            for sample in state.samples:
                self._sample_owner.pop(sample.request_id, None)
        return state

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    # ------------------------------------------------------------------ a step
    def process_outputs(self, core_outputs, now: float) -> tuple[list[RequestOutput | EmbeddingRequestOutput],
                                                                   dict[str, StopHit], dict[str, BaseException]]:
        """Apply one step of the core (``EngineCoreOutputs``).

        Returns:
            (outputs, stops, failures): the ``RequestOutput``s this step produces (none for
            a FINAL_ONLY request until it finishes; failed requests not included), the
            stop-string hits for the core (sample id -> ``StopHit``), and user request id ->
            exception for the requests whose output processing failed (still tracked: the
            caller aborts them in the core and makes their failure output).
        """
        outputs: list = []  # RequestOutputs, and the RequestStates of n > 1 requests made below
        stops: dict[str, StopHit] = {}
        failures: dict[str, BaseException] = {}
        for request_id in core_outputs.started:
            state = self.request_states.get(request_id)
            if state is not None and state.first_scheduled_time is None:
                state.first_scheduled_time = core_outputs.scheduled_time
        for request_id, positions in core_outputs.prompt_logprobs.items():
            state = self.request_states.get(request_id)
            if state is None:
                continue
            if state.prompt_logprobs_list is None:
                # (once given, they stay: a preempted sample's recomputation of its prompt,
                # which may differ in the last bits, is not given again)
                state.prompt_logprobs.update(positions)
        for request_id, (vector, num_cached_tokens) in core_outputs.pooled.items():
            state = self.request_states.get(request_id)
            if state is None:
                continue
            state.num_cached_tokens = num_cached_tokens
            vector = torch.nn.functional.normalize(vector, dim=0) if state.params.l2_normalize else vector
            state.embedding = vector.tolist()
            self._emit(state, now, outputs, failures)
        # A request of one sample (the common case) has its output made as soon as its tokens
        # are appended; one of n samples once all of them are (a placeholder keeps its place:
        # the outputs come in the order of each request's first sample in the step).
        owners = self._sample_owner
        append, emit = self._append, self._emit
        pending: dict[str, RequestState] = {}  # n > 1 samples, by user request id
        for out in core_outputs.outputs:
            owner = owners.get(out.request_id)
            if owner is None:
                continue
            state, sample = owner
            try:
                hit = append(state, sample, out)
            except Exception as exc:  # noqa: BLE001 - this request's fault
                failures.setdefault(state.request_id, exc)
                continue
            if hit is not None:
                stops[out.request_id] = hit
            if len(state.samples) == 1:
                if state.request_id not in failures:
                    emit(state, now, outputs, failures)
            elif state.request_id not in pending:
                pending[state.request_id] = state
                outputs.append(state)
        if pending:
            made = []
            for item in outputs:
                if type(item) is not RequestState:
                    made.append(item)
                elif item.request_id not in failures:
                    emit(item, now, made, failures)
            outputs = made
        return outputs, stops, failures

    def _emit(self, state: RequestState, now: float, outputs: list, failures: dict[str, BaseException]) -> None:
        """Make ``state``'s output for this step into ``outputs`` (none for a FINAL_ONLY
        request still running; a fault goes to ``failures``); stop tracking it once finished."""
        if state.first_token_time is None and not state.is_pooling:
            state.first_token_time = now
        try:
            output = self._make_output(state, now)
        except Exception as exc:  # noqa: BLE001 - this request's fault
            failures[state.request_id] = exc
            return
        if output is not None:
            outputs.append(output)
            finished = output.finished
        else:
            finished = state.finished
        if finished:
            self.abort_request(state.request_id)

    def _append(self, state: RequestState, sample: _SampleState, out) -> StopHit | None:
        """Record a sample's new tokens: text (token by token, so that a stop string ends it
        at the token that completed it), logprobs, cumulative logprob, finish."""
        if sample is state.samples[0]:  # the sample that computed the prompt
            state.num_cached_tokens = out.num_cached_tokens
        tokens = out.new_token_ids
        hit = None
        detok = sample.detokenizer
        if detok is not None:
            finished = out.finish_reason is not None
            # The token that stopped the output (EOS or a stop_token_ids entry) is not text
            # unless include_stop_str_in_output (vLLM's IncrementalDetokenizer): it stays in
            # token_ids only.
            stop_token = (out.finish_reason == "stop" and bool(tokens) and not state.params.include_stop_str_in_output
                          and (tokens[-1] == self.eos_token_id or tokens[-1] in state.params.stop_token_ids))
            if len(tokens) == 1 and not stop_token:  # (a decode step's one token)
                stop = detok.update(tokens, finished=finished)
                if stop is not None:
                    hit = StopHit(len(sample.token_ids) + 1, stop)
            else:
                last = len(tokens) - 1
                for i, token in enumerate(tokens[:-1] if stop_token else tokens):
                    stop = detok.update([token], finished=finished and i == last)
                    if stop is not None:
                        tokens = tokens[: i + 1]
                        hit = StopHit(len(sample.token_ids) + i + 1, stop)
                        break
                if stop_token and hit is None:
                    detok.update([], finished=True)  # (the text so far is final)
        sample.token_ids.extend(tokens)
        if out.new_logprobs is not None:
            decode = state.params.detokenize  # (detokenize=False: no decoded_token, as vLLM)
            for entry, token in zip(out.new_logprobs, tokens):
                sample.logprobs.append(self._decoded(entry) if decode else entry)
                sample.cumulative_logprob += entry[token]
        if hit is not None:
            sample.finish_reason, sample.stop_reason = "stop", hit.stop_reason
        elif out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        return hit

    def _decoded(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """``entry`` with every ``Logprob.decoded_token`` set (``tokenizer.decode([id])``,
        as vLLM; unchanged without a tokenizer)."""
        if self.tokenizer is None:
            return entry
        texts = self._token_texts
        out = {}
        for token, logprob in entry.items():
            text = texts.get(token)
            if text is None:
                text = texts[token] = self.tokenizer.decode([token])
            out[token] = logprob.with_decoded_token(text)
        return out

    # ------------------------------------------------------------------ outputs
    def _make_output(self, state: RequestState, now: float) -> RequestOutput | EmbeddingRequestOutput | None:
        if state.is_pooling:
            return EmbeddingRequestOutput(
                state.request_id, EmbeddingOutput(state.embedding), state.prompt_token_ids, state.num_cached_tokens,
                True, state.prompt,
                {"arrival_time": state.arrival_time, "first_scheduled_time": state.first_scheduled_time,
                 "finished_time": now},
            )
        samples = state.samples
        kind = state.output_kind
        params = state.params
        if len(samples) == 1:  # (a single sample: its finish is the request's)
            finished = samples[0].finish_reason is not None
        else:
            finished = state.finished
        if kind is _FINAL_ONLY and not finished:
            return None
        wants_logprobs = params.logprobs is not None
        metrics = RequestMetrics(state.arrival_time, state.first_scheduled_time, state.first_token_time,
                                 now if finished else None)
        delta = kind is _DELTA
        if not delta and not wants_logprobs and len(samples) == 1:  # the common case, without the loop
            sample = samples[0]
            detok = sample.detokenizer
            completions = [CompletionOutput(0, detok.text if detok is not None else "", list(sample.token_ids),
                                            sample.finish_reason, sample.stop_reason, lora_request=state.lora_request)]
            samples = ()
        else:
            completions = []
        for index, sample in enumerate(samples):
            if delta:
                text = sample.detokenizer.text_since(sample.num_sent_chars) if sample.detokenizer is not None else ""
                sample.num_sent_chars += len(text)
                start = sample.num_sent_tokens
                token_ids = sample.token_ids[start:]
                logprobs = sample.logprobs[start:] if wants_logprobs else None
                sample.num_sent_tokens = len(sample.token_ids)
            else:
                text = sample.detokenizer.text if sample.detokenizer is not None else ""
                token_ids = list(sample.token_ids)
                logprobs = list(sample.logprobs) if wants_logprobs else None
            completions.append(CompletionOutput(
                index=index, text=text, token_ids=token_ids, finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason, logprobs=logprobs,
                cumulative_logprob=sample.cumulative_logprob if wants_logprobs else None,
                lora_request=state.lora_request,
            ))
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids, completions, finished, metrics,
            self._prompt_logprobs(state, finished) if params.prompt_logprobs is not None else None,
            None, state.num_cached_tokens, state.lora_request,
        )

    def _prompt_logprobs(self, state: RequestState, finished: bool) -> list[dict[int, Logprob] | None] | None:
        """The prompt logprobs an output of ``state`` carries, as vLLM's: from the first
        output after the prompt's last position is computed (its first token's), the whole
        list on every CUMULATIVE / FINAL_ONLY output, on the first DELTA output only (None
        before, and on the DELTA outputs after)."""
        plp = state.prompt_logprobs_list
        if plp is None:
            positions = state.prompt_logprobs
            n = len(state.prompt_token_ids)
            if len(positions) < n - 1 and not finished:  # (a position p >= 1 each)
                return None
            # as vLLM: None for the first prompt token, which has no predecessor
            decode = self._decoded if state.params.detokenize else (lambda entry: entry)
            plp = state.prompt_logprobs_list = [None, *(decode(positions[i]) for i in range(1, n))]
        if state.output_kind is _DELTA:
            if state.prompt_logprobs_sent:
                return None
            state.prompt_logprobs_sent = True
        return plp

    def make_failure_output(self, request_id: str, exc: BaseException, now: float,
                            token_ids: list[list[int]] | None = None) -> RequestOutput | EmbeddingRequestOutput | None:
        """The final output of a user request the engine failed (``error`` set, every
        finish_reason "error"), and stop tracking it. ``token_ids``: each sample's output
        tokens as the core had them (default: those this processor saw). None when the
        request is not tracked."""
        state = self.abort_request(request_id)
        if state is None:
            return None
        failure = RequestFailure.from_exception(exc)
        if state.is_pooling:
            return EmbeddingRequestOutput(
                request_id, EmbeddingOutput([]), state.prompt_token_ids, state.num_cached_tokens, True, state.prompt,
                {"arrival_time": state.arrival_time, "first_scheduled_time": state.first_scheduled_time,
                 "finished_time": now},
                error=failure,
            )
        if token_ids is None:
            token_ids = [list(s.token_ids) for s in state.samples]
        delta = state.output_kind is RequestOutputKind.DELTA
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[
                CompletionOutput(index=i, text="", token_ids=ids[s.num_sent_tokens:] if delta else ids,
                                 finish_reason="error", lora_request=state.lora_request)
                for i, (s, ids) in enumerate(zip(state.samples, token_ids))
            ],
            finished=True,
            metrics={"arrival_time": state.arrival_time, "first_scheduled_time": state.first_scheduled_time,
                     "first_token_time": state.first_token_time, "finished_time": now},
            error=failure,
            lora_request=state.lora_request,
        )
