"""The attention-backend selector (``kvflow.attention.selector``): the one place that
chooses by device, dtypes and the user's ``attention_backend``."""

from __future__ import annotations

import logging

import pytest
import torch

from kvflow.attention.selector import select_attention_backend
from kvflow.attention.triton_attention import triton_available

CPU = torch.device("cpu")
F32 = torch.float32


def test_unknown_name_names_the_field():
    with pytest.raises(ValueError, match="attention_backend"):
        select_attention_backend("flashinfer", CPU, F32, F32)


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    import kvflow.attention.triton_attention as ta

    # tests/conftest.py set TRITON_INTERPRET=1 before the kernels were first imported
    assert ta.interpreter_enabled() == (not torch.cuda.is_available())
    monkeypatch.setattr(ta, "interpreter_enabled", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_attention_backend("triton", CPU, F32, F32)
    monkeypatch.setattr(ta, "interpreter_enabled", lambda: True)
    assert select_attention_backend("triton", CPU, F32, F32).name == "triton"
    assert select_attention_backend("triton", CPU, F32, torch.int8).needs_batch_invariant_linears
    assert not select_attention_backend("triton", CPU, F32, F32).needs_batch_invariant_linears
    with pytest.raises(ValueError, match="bfloat16"):
        select_attention_backend("triton", CPU, torch.bfloat16, torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
def test_auto_backend_is_triton_on_cuda():
    assert select_attention_backend("auto", torch.device("cuda"), torch.bfloat16, torch.bfloat16).name == "triton"


def test_auto_backend_on_the_cpu_follows_the_kernel(monkeypatch):
    import kvflow.attention.cpu_attention as ca

    monkeypatch.setattr(ca, "cpu_kernel_available", lambda: True)
    assert select_attention_backend("auto", CPU, F32, F32).name == "cpu"
    monkeypatch.setattr(ca, "cpu_kernel_available", lambda: False)
    assert select_attention_backend("auto", CPU, F32, F32).name == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu'"):
        select_attention_backend("cpu", CPU, F32, F32)


def test_cpu_backend_variants_by_cache_dtype(monkeypatch, caplog):
    """Over a quantized cache the C++ path attends every token as a one-token decode and asks
    for batch-invariant linears; a float cache of another dtype than the model's (which the
    decode kernel cannot read) takes the PyTorch path, and says so (it used to be a silent
    downgrade inside the model runner)."""
    import kvflow.attention.cpu_attention as ca

    monkeypatch.setattr(ca, "cpu_kernel_available", lambda: True)
    plain = select_attention_backend("cpu", CPU, F32, F32)
    assert type(plain).__name__ == "CpuAttentionBackend" and not plain.needs_batch_invariant_linears
    quantized = select_attention_backend("cpu", CPU, F32, torch.int8)
    assert type(quantized).__name__ == "CpuQuantizedAttentionBackend" and quantized.needs_batch_invariant_linears
    with caplog.at_level(logging.INFO, logger="kvflow.attention.selector"):
        other = select_attention_backend("cpu", CPU, torch.bfloat16, F32)
    assert other.name == "torch"
    assert any("model's dtype only" in r.getMessage() for r in caplog.records)


def test_the_choice_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="kvflow.attention.selector"):
        select_attention_backend("torch", CPU, F32, F32)
    assert [r.getMessage() for r in caplog.records if r.name == "kvflow.attention.selector"] == [
        "attention backend: TorchAttentionBackend() (requested; cpu, model float32, KV cache float32)"
    ]


def test_windowed_models_get_a_backend_with_the_window(monkeypatch, caplog):
    """A model with sliding-window layers never runs a backend that would attend to the whole
    context: "auto" moves from the C++ quantized-cache path (no window) to PyTorch's, logged;
    asking for it by name is refused. The float C++ backend handles windows itself."""
    import kvflow.attention.cpu_attention as ca

    monkeypatch.setattr(ca, "cpu_kernel_available", lambda: True)
    assert select_attention_backend("auto", CPU, F32, F32, sliding_window=True).name == "cpu"
    assert select_attention_backend("auto", CPU, F32, torch.int8).name == "cpu"
    with caplog.at_level(logging.INFO, logger="kvflow.attention.selector"):
        backend = select_attention_backend("auto", CPU, F32, torch.int8, sliding_window=True)
    assert backend.name == "torch" and backend.supports_sliding_window
    assert any("no sliding-window attention" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="attention_backend='cpu'.*sliding-window"):
        select_attention_backend("cpu", CPU, F32, torch.int8, sliding_window=True)


def test_a_kernel_building_in_the_background(monkeypatch):
    """While the C++ kernel builds in the background, "auto" over a float cache picks the cpu
    backend at once (its decodes take the PyTorch path until the kernel is published); a
    quantized cache, which has no PyTorch path there, or attention_backend="cpu" waits for
    the build."""
    import threading

    import kvflow.attention.cpu_attention as ca
    from kvflow.ops.build import CppKernel

    monkeypatch.delenv("KVFLOW_CPU_KERNELS", raising=False)
    monkeypatch.delenv("KVFLOW_CPU_ATTENTION", raising=False)
    release = threading.Event()
    fake = CppKernel("kvflow_test_fake_attention", ca._EXTENSION.source_path, "KVFLOW_CPU_ATTENTION", "fake")
    monkeypatch.setattr(fake, "is_built", lambda: False)
    monkeypatch.setattr(fake, "_compile_in_subprocess", lambda: None)
    monkeypatch.setattr(fake, "_build", lambda: release.wait(30) and object())
    monkeypatch.setattr(ca, "_EXTENSION", fake)
    fake._claim_background()
    threading.Thread(target=fake._build_in_background, daemon=True).start()
    backend = select_attention_backend("auto", CPU, F32, F32)
    assert type(backend).__name__ == "CpuAttentionBackend" and fake.pending() and not ca.cpu_kernel_available()
    threading.Timer(0.2, release.set).start()
    quantized = select_attention_backend("auto", CPU, F32, torch.int8)
    assert type(quantized).__name__ == "CpuQuantizedAttentionBackend" and not fake.pending()
    assert ca.cpu_kernel_available()


def test_choosing_a_cpu_backend_does_not_import_triton():
    """On the CPU ("auto", "torch") the selector never imports triton (~64 MiB of resident
    shared libraries and ~0.3 s of a start), only where the Triton backend is asked about."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from kvflow.attention.selector import select_attention_backend\n"
            "for name in ('auto', 'torch'):\n"
            "    select_attention_backend(name, torch.device('cpu'), torch.float32, torch.float32)\n"
            "print('triton' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "KVFLOW_CPU_KERNEL_BUILD": "background"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
