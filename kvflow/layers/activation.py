"""SiLU-and-mul: the SwiGLU activation of a merged gate/up projection (vLLM's ``silu_and_mul``).

SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6) is
``FFN(x) = (silu(x W) * (x V)) W2`` with silu(z) = z * sigmoid(z) (Elfwing et al. 2018,
"Sigmoid-Weighted Linear Units for Neural Network Function Approximation in Reinforcement
Learning"). kvflow's MLPs compute ``x W`` and ``x V`` as one merged projection [T, 2I]
(gate first, up second); ``silu_and_mul`` turns it into [T, I].

On the CPU a small C++ kernel (``kvflow/ops/csrc/activation.cpp``, built on first use like
the others in ``kvflow.ops``) reads each row once and writes the result once, where
``F.silu(gate) * up`` makes two ATen passes, a temporary and a strided read of the halves.
Arithmetic: float32, with PyTorch's roundings (silu(gate) rounded to the input dtype, then
the product): bfloat16 results are F.silu(gate) * up's (one in a million moved by one step
in our tests, where the two e^x round differently); float32 ones differ by up to 5 ulp
for |gate| < 80 (e^x is a Cephes-style polynomial within 2 ulp, ATen's within 1; against
the exact value the kernel is within 4.1 ulp, ATen within 3.0; below gate = -87.3 the
kernel's silu is -0 where ATen's is a tiny number down to -88.7). One thread, x [4096, 3072]: bfloat16
4.9 ms against 8.9 ms, float32 5.0 ms against 9.3 ms (``activation.cpp``'s header).
Models take the kernel in bfloat16 only (``silu_and_mul``); float32 keeps the reference.
Where the kernel does not apply (float32, another dtype, not 2-D, autograd, not built) and
with ``KVFLOW_CPU_ACTIVATION=0`` ``F.silu(gate) * up`` runs, the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow import ops
from kvflow.ops.build import takes_kernel_input

_EXTENSION = ops.ACTIVATION


def cpu_silu_and_mul_available() -> bool:
    """True when the C++ SiLU-and-mul kernel is built (building it now if needed)."""
    return _EXTENSION.load() is not None


def cpu_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate | up] with the C++ kernel.

    Shapes and dtypes: x [T, 2I], float32 or bfloat16, a CPU tensor whose rows are
    contiguous (any row stride); gate is x[:, :I], up is x[:, I:]. Returns a new [T, I]
    tensor of x's dtype: silu(gate) * up in float32 arithmetic with PyTorch's roundings
    (silu(gate) rounded to x's dtype, then the product).

    Source: SwiGLU, Shazeer 2020, "GLU Variants Improve Transformer", eq. 6; SiLU, Elfwing
    et al. 2018.

    Raises:
        RuntimeError: if the kernel is unavailable, or x is not 2-D, has an odd number of
            columns, non-contiguous rows, or another dtype (the message names ``x``).
    """
    return _EXTENSION.require().silu_and_mul(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x [..., 2I] (gate the first half of the last dimension, up the
    second) -> [..., I] of x's dtype: the C++ kernel where it applies (a 2-D bfloat16 CPU
    tensor with contiguous rows, no autograd, the kernel built), else the PyTorch reference
    ``F.silu(gate) * up``.

    float32 keeps the reference: it is the exactness dtype, and the kernel's e^x (within 2
    ulp, ATen's within 1) moves a last bit, which the int8 activations of the next GGUF
    product amplify (the fused decode step's float32 SiLU, ``fused_decode.cpp``, follows
    ATen element by element for the same reason; under the AVX2 caps its test against this
    path failed with the kernel in float32). In bfloat16 the kernel's values are PyTorch's
    (both round silu(gate) to bfloat16 first)."""
    if (x.dtype == torch.bfloat16 and takes_kernel_input(x, 2) and x.shape[-1] % 2 == 0
            and cpu_silu_and_mul_available()):
        return cpu_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
