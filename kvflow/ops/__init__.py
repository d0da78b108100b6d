"""kvflow's C++ CPU kernels: one source file each in ``kvflow/ops/csrc``, built once per CPU.

=====================  ==========================  ===============================  ============================
kernel                 source                      switch (``kvflow.envs``)         Python side
=====================  ==========================  ===============================  ============================
``PAGED_ATTENTION``    ``paged_attention.cpp``     ``KVFLOW_CPU_ATTENTION``         ``attention/cpu_attention.py``
``INT8_LINEAR``        ``int8_linear.cpp``         ``KVFLOW_CPU_LINEAR``            ``layers/cpu_linear.py``
``RMS_NORM``           ``rms_norm.cpp``            ``KVFLOW_CPU_NORM``              ``layers/norm.py``
``ROTARY``             ``rotary.cpp``              ``KVFLOW_CPU_ROTARY``            ``layers/rotary.py``
``INVARIANT_LINEAR``   ``invariant_linear.cpp``    ``KVFLOW_CPU_INVARIANT_LINEAR``  ``layers/invariant_linear.py``
``GGUF_MATMUL``        ``gguf_matmul.cpp``         ``KVFLOW_CPU_GGUF``              ``layers/gguf_kernels.py``
``FUSED_DECODE``       ``fused_decode.cpp``        ``KVFLOW_CPU_FUSED_DECODE``      ``layers/fused_decode.py``
``ACTIVATION``         ``activation.cpp``          ``KVFLOW_CPU_ACTIVATION``        ``layers/activation.py``
=====================  ==========================  ===============================  ============================

Each is a :class:`kvflow.ops.build.CppKernel`: ``load()`` builds it once (or returns None:
no compiler, a failed build, switched off) and the Python side falls back to PyTorch. The
sources are package data (``pyproject.toml``), so an installed kvflow builds the same way
as a checkout. ``python -m kvflow.ops`` builds all of them now (for an image or a machine
where the first request should not pay for them), as many at once as there are CPUs
(``--jobs``), the largest first. The sources include ``torch/types.h`` and
``torch/csrc/Exceptions.h`` (tensors, pybind11's casters, ``torch::wrap_pybind_function``)
rather than ``torch/extension.h``, whose C++ frontend (``torch/all.h``) they do not use and
which took about a third of a small kernel's compile.

When they are built (issue #16; a cold build of the five costs about 234 CPU-seconds of
compiler time, a cached load well under a second each: docs/development.md, "Kernels"):

- **At run time** (this, as before): ``-march=native`` fits every CPU exactly (AVX-512 and
  AVX512-BF16 where present, AVX2 or a portable loop elsewhere, Arm too), the build matches
  the installed torch's C++ ABI whatever its version, and no compiler is needed to install
  (without one kvflow runs PyTorch's operators). The cost is the first run's builds, which
  nobody waits for since issue #17: an engine on the CPU starts the builds it lacks in the
  background (``kvflow.ops.build.start_background_builds``: a niced child process, one
  kernel at a time), serves on the PyTorch paths, and switches to each kernel between two
  steps once it is built (``publish_background_builds``; ``KVFLOW_CPU_KERNEL_BUILD=wait``
  restores build-on-first-use).
- **At install time** (``setup.py`` + ``CppExtension``): the same builds, paid in ``pip
  install`` instead of the first run (no faster), but only with
  ``--no-build-isolation`` (an isolated build would compile against a freshly downloaded
  torch of possibly another version, whose ABI the installed one does not share), a
  compiler becomes an install requirement, and an editable install's edits to a kernel are
  no longer picked up.
- **Prebuilt per instruction set** (wheels with x86-64-v3 / -v4 / aarch64 builds): no
  build at all, but one set of binaries per torch version (libtorch's C++ ABI is not stable
  across releases: the wheel would pin ``torch==`` exactly), per platform, and the generic
  levels lose what ``-march=native`` finds (x86-64-v4 has no AVX512-BF16, which the
  attention kernel's bfloat16 scoring uses).
"""

from __future__ import annotations

from kvflow.ops.build import CppKernel, publish_background_builds, start_background_builds

PAGED_ATTENTION = CppKernel("kvflow_cpu_paged_attention", "paged_attention.cpp", "KVFLOW_CPU_ATTENTION",
                            "CPU paged-attention kernel", includes=("vec_exp.h",))
INT8_LINEAR = CppKernel("kvflow_cpu_linear", "int8_linear.cpp", "KVFLOW_CPU_LINEAR", "CPU weight-only INT8 kernel")
RMS_NORM = CppKernel("kvflow_cpu_rms_norm", "rms_norm.cpp", "KVFLOW_CPU_NORM", "CPU RMSNorm kernel")
ACTIVATION = CppKernel("kvflow_cpu_activation", "activation.cpp", "KVFLOW_CPU_ACTIVATION", "CPU SiLU-and-mul kernel",
                       includes=("vec_exp.h",))
ROTARY = CppKernel("kvflow_cpu_rotary", "rotary.cpp", "KVFLOW_CPU_ROTARY", "CPU rotary kernel")
INVARIANT_LINEAR = CppKernel("kvflow_cpu_invariant_linear", "invariant_linear.cpp", "KVFLOW_CPU_INVARIANT_LINEAR",
                             "batch-invariant linear kernel")
GGUF_MATMUL = CppKernel("kvflow_cpu_gguf_matmul", "gguf_matmul.cpp", "KVFLOW_CPU_GGUF", "CPU GGUF quantized matmul kernel")

FUSED_DECODE = CppKernel("kvflow_cpu_fused_decode", "fused_decode.cpp", "KVFLOW_CPU_FUSED_DECODE",
                         "CPU fused decode-step kernel", includes=("gguf_matmul.cpp", "paged_attention.cpp", "vec_exp.h"))

KERNELS: tuple[CppKernel, ...] = (PAGED_ATTENTION, INT8_LINEAR, RMS_NORM, ROTARY, INVARIANT_LINEAR, GGUF_MATMUL,
                                  FUSED_DECODE, ACTIVATION)
"""Every kernel of the package."""

__all__ = ["CppKernel", "KERNELS", "publish_background_builds", "start_background_builds", "PAGED_ATTENTION", "INT8_LINEAR", "RMS_NORM", "ROTARY", "INVARIANT_LINEAR", "GGUF_MATMUL", "FUSED_DECODE", "ACTIVATION"]
