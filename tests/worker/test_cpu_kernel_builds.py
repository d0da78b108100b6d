"""kvflow.worker.worker: which C++ kernels an engine builds in the background."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvflow import ops
from kvflow.worker import worker


def _config(quantization):
    return SimpleNamespace(device=SimpleNamespace(device=torch.device("cpu")),
                           parallel=SimpleNamespace(tensor_parallel_size=1),
                           load=SimpleNamespace(quantization=quantization, quantize_lm_head=False))


def test_a_gguf_model_builds_its_matmul_kernel_first_in_the_background(monkeypatch):
    started = []
    monkeypatch.setenv("KVFLOW_CPU_KERNEL_BUILD", "background")
    monkeypatch.setattr(ops, "start_background_builds", lambda kernels: started.append(list(kernels)) or kernels)
    worker.start_cpu_kernel_builds(_config("gguf"))
    worker.start_cpu_kernel_builds(_config(None))
    worker.start_cpu_kernel_builds(_config("int8"))
    assert started == [[ops.GGUF_MATMUL, ops.PAGED_ATTENTION, ops.RMS_NORM, ops.ROTARY, ops.FUSED_DECODE],
                       [ops.PAGED_ATTENTION, ops.RMS_NORM, ops.ROTARY],
                       [ops.PAGED_ATTENTION, ops.RMS_NORM, ops.ROTARY, ops.INT8_LINEAR]]
    monkeypatch.setenv("KVFLOW_CPU_KERNEL_BUILD", "wait")
    assert worker.start_cpu_kernel_builds(_config("gguf")) == [] and len(started) == 3
