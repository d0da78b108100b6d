"""Weight-only INT8 matrix products for a few rows, as a small C++ kernel (AVX-512).

Decoding reads every weight once per step for one or a few rows of activations, so a
weight-only quantized linear is bound by how fast the compact weight streams through the
cores. PyTorch's ``aten._weight_int8pack_mm`` reached about 10 GB/s of INT8 weight at one
row on the development machine (2 cores, SmolLM2's 30 x 4 decoder linears, 107 MB); this
kernel reads the weight in its stored layout, int8 [N, K] with a float32 scale per output
channel (the INT8 method, ``kvflow.quantization.int8``), at about 25 GB/s there.

y[m, n] = scale[n] * sum_k x[m, k] w[n, k], activations and accumulation in float32: a
program takes a tile of 16 / M output channels for M <= 4 rows (more rows: groups of four,
one pass over the weight each), widens 16 weights at a time to float32 and multiply-adds
them with the rows, then reduces the tile's 16 accumulators together with one
transpose-and-add tree (as ``cpu_attention``). A tile's rows are one contiguous region of
the weight, read 16 columns at a time across its rows, which is too short a stream per row
for the hardware prefetcher: the next tile's region is prefetched in software.

The C++ source is ``kvflow/ops/csrc/int8_linear.cpp`` (built on first use by
``kvflow.ops.build``). Needs AVX-512 (F, BW) and K % 16 == 0: ``int8_available()`` is False
without them, if the build fails, or with ``KVFLOW_CPU_LINEAR=0``, and the INT8 method keeps
PyTorch's kernel.
(An INT4 kernel in the same style was measured slower than PyTorch's
``_weight_int4pack_mm_for_cpu`` here and is not kept.)
"""

from __future__ import annotations

import torch

from kvflow import ops

# Rows per call the kernel takes (the INT8 method sends it at most INT8_PACKED_MAX_ROWS).
MAX_ROWS = 64

_EXTENSION = ops.INT8_LINEAR


def int8_available() -> bool:
    """True when the INT8 kernel is built (building it now if needed) and this CPU runs it."""
    module = _EXTENSION.load()
    return module is not None and module.int8_supported()


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = (x W^T) with W = weight * scale[:, None].

    Args:
        x: [M, K] with contiguous rows, 1 <= M <= ``MAX_ROWS``, float32 or bfloat16
            (computed in float32).
        weight: int8 [N, K], contiguous, K % 16 == 0.
        scale: float32 [N], contiguous.

    Returns:
        [M, N] in x's dtype.

    Raises:
        RuntimeError: if the kernel is unavailable or the inputs break the layout above.
    """
    return _EXTENSION.require().int8_linear(x, weight, scale)
