"""benchmarks/kv_decode.py: its bounds, and that each checkout's own kvflow is measured."""

from __future__ import annotations

import pytest

from benchmarks import kv_decode
from tests.conftest import tiny_hf_model_dir


def test_bounds_are_checked():
    for bad in (["--tokens", "1"], ["--streams", "0"], ["--rounds", "0"], ["--kv-dtypes", " , "]):
        with pytest.raises(ValueError):
            kv_decode.main(bad)


def test_a_baseline_checkout_is_measured_with_its_own_kvflow(tmp_path):
    """The child runs with the checkout's kvflow first on its path (not the benchmark's own,
    which `python -m` from the repository would put first), and times a decode step."""
    model = tiny_hf_model_dir(tmp_path / "model")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "kvflow").symlink_to(kv_decode.REPO / "kvflow", target_is_directory=True)
    args = kv_decode.parse_args(["--model", str(model), "--streams", "2", "--prompt-len", "8", "--tokens", "3"])
    assert kv_decode.measure(checkout, "int8", args) > 0
    (checkout / "kvflow").unlink()
    (checkout / "kvflow").mkdir()
    (checkout / "kvflow" / "__init__.py").write_text("raise ImportError('the baseline kvflow')\n")
    with pytest.raises(RuntimeError, match="the baseline kvflow"):
        kv_decode.measure(checkout, "int8", args)
