"""A model of one engine step's duration, fitted as the steps run: a fixed part (launching
the step: scheduling, input preparation, the per-layer dispatch, sampling) plus a part per
scheduled token (the GEMMs and attention of prefill chunks and decodes).

The scheduler bounds a step in time with it (``SchedulerConfig.max_step_seconds``): the next
step's token budget is the number of tokens whose predicted duration fits the bound. A single
rate (``tokens / seconds`` of past steps) counts the fixed part as if it were per token: after
a run of small decode steps it measures a low throughput and keeps prompt chunks far smaller
than the bound allows, each chunk paying the fixed cost again. Fitting both parts keeps the
chunks as large as the bound permits.

The fit is weighted least squares over the observed steps, each step's weight decaying by
``decay`` per later step (recursive least squares with exponential forgetting; Haykin,
Adaptive Filter Theory, chapter on RLS), so that a machine that becomes faster or slower is
followed within a few tens of steps.
"""

from __future__ import annotations

import math

__all__ = ["StepTimeModel"]


class StepTimeModel:
    """Step duration = ``fixed_seconds`` + ``seconds_per_token`` x scheduled tokens.

    Args:
        decay: weight kept by each past step per new one, in (0, 1).

    Raises:
        ValueError: for a ``decay`` outside (0, 1).

    Until the steps seen differ enough in size to separate the two parts (a relative spread
    of their token counts below ``MIN_SPREAD``), the fit is through the origin
    (``fixed_seconds`` = 0, every second charged to the tokens: the conservative choice).
    """

    MIN_SPREAD = 0.1  # weighted std of the token counts / their weighted mean

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        self.decay = decay
        # Exponentially weighted sums of 1, n, t, n^2 and n*t over the observed steps.
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self.fixed_seconds = 0.0
        self.seconds_per_token: float | None = None  # None: no step observed yet

    @classmethod
    def fixed(cls, fixed_seconds: float, seconds_per_token: float) -> StepTimeModel:
        """A model with the given parts that then learns from steps as usual (tests, replays).

        Raises:
            ValueError: for a negative ``fixed_seconds`` or a ``seconds_per_token`` <= 0.
        """
        if not (fixed_seconds >= 0 and seconds_per_token > 0):
            raise ValueError(f"need fixed_seconds >= 0 and seconds_per_token > 0, got {fixed_seconds!r}, "
                             f"{seconds_per_token!r}")
        model = cls()
        model.fixed_seconds, model.seconds_per_token = float(fixed_seconds), float(seconds_per_token)
        return model

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Fold one step (``num_tokens`` scheduled tokens that took ``seconds``) into the fit.
        Steps of no tokens or no measurable time are ignored."""
        if num_tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        d, n, t = self.decay, float(num_tokens), float(seconds)
        self._w = d * self._w + 1.0
        self._n = d * self._n + n
        self._t = d * self._t + t
        self._nn = d * self._nn + n * n
        self._nt = d * self._nt + n * t
        self._fit()

    def _fit(self) -> None:
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var_n = max(self._nn / self._w - mean_n * mean_n, 0.0)
        if var_n > (self.MIN_SPREAD * mean_n) ** 2:
            slope = (self._nt / self._w - mean_n * mean_t) / var_n
            fixed = mean_t - slope * mean_n
            if slope > 0 and fixed >= 0:
                self.fixed_seconds, self.seconds_per_token = fixed, slope
                return
            if slope > 0:  # the line crosses zero above no tokens: all time is per token
                self.fixed_seconds, self.seconds_per_token = 0.0, self._nt / self._nn
                return
        # Steps of one size (or larger steps measured no slower): charge every second to the
        # tokens, the least-squares line through the origin.
        self.fixed_seconds, self.seconds_per_token = 0.0, self._nt / self._nn

    def predict(self, num_tokens: int) -> float | None:
        """Predicted seconds of a step of ``num_tokens`` tokens; None before any step."""
        if self.seconds_per_token is None:
            return None
        return self.fixed_seconds + self.seconds_per_token * num_tokens

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step can schedule and be predicted to last at most ``seconds``
        (0 when the fixed part alone exceeds it); None before any step."""
        if self.seconds_per_token is None:
            return None
        return max(0, math.floor((seconds - self.fixed_seconds) / self.seconds_per_token + 1e-6))  # + rounding
