"""benchmarks/sampling.py: its bounds, and that each checkout's own kvflow is measured."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import sampling


def test_bounds_are_checked():
    for bad in (["--shapes", "16"], ["--shapes", "0x100"], ["--repeats", "0"], ["--rounds", "0"],
                ["--max-num-seqs", "0"], ["--skip-sampler"]):
        with pytest.raises(SystemExit):
            sampling.parse_args(bad)


def test_a_checkout_is_measured_with_its_own_kvflow(tmp_path):
    """The child imports the checkout's kvflow (not the benchmark's) and times each case."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "kvflow").symlink_to(sampling.REPO / "kvflow", target_is_directory=True)
    (checkout / "benchmarks").symlink_to(sampling.REPO / "benchmarks", target_is_directory=True)
    args = sampling.parse_args(["--shapes", "4x3000", "--settings", "top-p", "qwen", "--repeats", "1"])
    rows = sampling.run_checkout(checkout, args, "sampler")
    assert [(r["logits"], r["setting"]) for r in rows] == [("lm", "top-p"), ("lm", "qwen"), ("flat", "top-p"),
                                                           ("flat", "qwen")]
    assert all(r["ms"] > 0 for r in rows)
    (checkout / "kvflow").unlink()
    (checkout / "kvflow").mkdir()
    (checkout / "kvflow" / "__init__.py").write_text("raise ImportError('the baseline kvflow')\n")
    with pytest.raises(RuntimeError, match="the baseline kvflow"):
        sampling.run_checkout(checkout, args, "sampler")


def test_lm_logits_have_a_language_models_nucleus():
    """At temperature 0.7 the top_p 0.9 nucleus of the 'lm' logits is a few dozen tokens (the
    case the sampler's first candidates cover), of the flat ones most of the vocabulary."""
    import torch

    probs = (sampling.lm_logits(2, 49152, 0) / 0.7).softmax(-1).sort(dim=-1, descending=True).values
    nucleus = (probs.cumsum(-1) < 0.9).sum(-1) + 1
    assert bool((nucleus > 5).all()) and bool((nucleus < 64).all()), nucleus
    assert isinstance(sampling.parse_args([]), argparse.Namespace)
