"""``Logprob``: vLLM's fields on a float, so that old ``dict[int, float]`` code keeps working."""

from __future__ import annotations

import copy
import json
import pickle

from kvflow.logprobs import Logprob


def test_logprob_is_a_float_with_vllm_fields():
    lp = Logprob(-0.25, rank=2, decoded_token=" the")
    assert isinstance(lp, float)
    assert (lp.logprob, lp.rank, lp.decoded_token) == (-0.25, 2, " the")
    assert type(lp.logprob) is float
    # Old code: arithmetic, sums, comparisons, dict equality, max by value, JSON numbers.
    assert lp + 1.0 == 0.75 and sum([lp, lp]) == -0.5 and lp < 0
    assert {3: lp} == {3: -0.25}
    assert max({1: Logprob(-3.0, 2), 2: lp}.items(), key=lambda kv: kv[1])[0] == 2
    assert json.dumps({"lp": lp}) == '{"lp": -0.25}'
    assert hash(lp) == hash(-0.25)


def test_logprob_equality_and_copies():
    lp = Logprob(-1.5, 1, "a")
    assert lp == Logprob(-1.5, 1, "a")
    assert lp != Logprob(-1.5, 2, "a") and lp != Logprob(-1.5, 1, "b")
    assert Logprob(-1.5) != -1.0
    for clone in (pickle.loads(pickle.dumps(lp)), copy.deepcopy(lp), copy.copy(lp)):
        assert type(clone) is Logprob and clone == lp
    assert lp.with_decoded_token("z") == Logprob(-1.5, 1, "z")
    assert "rank=1" in repr(lp)
