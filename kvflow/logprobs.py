"""Log-probability entries in vLLM's shape (``vllm.logprobs.Logprob``), float-like.

vLLM reports each position's log-probabilities as ``dict[int, Logprob]`` where a ``Logprob``
carries ``.logprob``, ``.rank`` (1 = the most likely token) and ``.decoded_token``. kvflow's
entries used to be plain floats; ``Logprob`` subclasses ``float`` so that both kinds of code
work on the same dict: ``entry[t].logprob`` and ``entry[t] + 1.0``, ``sum(...)``, ``json``
(which writes the number), comparisons with floats.
"""

from __future__ import annotations


class Logprob(float):
    """The log-probability of one token at one position (a float, natural log).

    Attributes:
        logprob: the value, as a plain float (``float(self)``).
        rank: the token's rank in the position's distribution, 1 for the most likely
            token: as vLLM, the number of vocabulary entries whose log-probability is >=
            this one's (for a top-k entry, its place in the top k); None when unknown.
        decoded_token: the token's text (``tokenizer.decode([token_id])``, as vLLM), or None
            without a tokenizer.

    Equality: with another ``Logprob`` all three fields are compared; with a number, the
    value (so ``{5: Logprob(-0.1)} == {5: -0.1}``). The hash is the float's.
    """

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> "Logprob":
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def with_decoded_token(self, decoded_token: str | None) -> "Logprob":
        """A copy carrying ``decoded_token``."""
        return Logprob(float(self), self.rank, decoded_token)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Logprob):
            return (float(self) == float(other) and self.rank == other.rank
                    and self.decoded_token == other.decoded_token)
        return float.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    __hash__ = float.__hash__

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __reduce__(self):
        return (Logprob, (float(self), self.rank, self.decoded_token))


# One position's entries: token id -> Logprob.
LogprobsOnePosition = dict[int, Logprob]
