"""kvflow's environment switches: every ``KVFLOW_*`` variable is read here, and only here.

Each switch is read when it is asked for: ``kvflow.envs.KVFLOW_CPU_MARCH`` looks at
``os.environ`` at that moment (a module ``__getattr__``, as vLLM's ``vllm/envs.py``), so a
test can ``monkeypatch.setenv`` and a program can change a variable before the part that
reads it runs. ``read(name, environ)`` reads one from another mapping. The table
``SWITCHES`` holds each switch's name, type, default and effect; docs/envs.md is generated
from it by ``markdown()`` (``python -c 'from kvflow.envs import markdown; print(markdown(),
end="")' > docs/envs.md``; tests/test_envs.py checks the file equals the generated text).

``EXTERNAL`` lists the variables of other programs that kvflow reads (torchrun's rank
variables, libgomp's wait policy, the C++ compiler), read through ``read`` too.

Switches and when they are read:

- ``KVFLOW_CACHE_DIR`` (path; default ``~/.cache/kvflow/models``): where converted GGUF
  models are cached (``kvflow.model.resolve.default_cache_dir``; ``EngineArgs.model_cache_dir``
  wins over it).
- ``KVFLOW_CPU_MARCH`` (str; default ``native``): the ``-march`` target of kvflow's C++ CPU
  kernels (``kvflow.ops.build``), e.g. ``x86-64-v3`` for an AVX2 CPU without AVX-512; a
  target beyond this CPU is refused with the features it lacks, one the compiler does not
  know with the compiler's complaint.
- ``KVFLOW_CPU_KERNELS`` (bool; default on): ``0`` keeps every C++ CPU kernel unbuilt (the
  PyTorch paths run); each kernel also has its own switch:
  ``KVFLOW_CPU_ATTENTION`` (paged attention), ``KVFLOW_CPU_NORM`` (RMSNorm),
  ``KVFLOW_CPU_ACTIVATION`` (SiLU-and-mul, the SwiGLU activation),
  ``KVFLOW_CPU_ROTARY`` (rotary embedding), ``KVFLOW_CPU_LINEAR`` (weight-only INT8),
  ``KVFLOW_CPU_INVARIANT_LINEAR`` (batch-invariant linears), ``KVFLOW_CPU_GGUF`` (GGUF
  quantized matmuls), ``KVFLOW_CPU_FUSED_DECODE`` (decode steps in one call), read when the kernel is
  first asked for (and decided once per process).
- ``KVFLOW_CPU_PREFILL_ATTENTION`` (bool; default on): ``0`` sends prefill chunks on the CPU
  to gather + ``scaled_dot_product_attention`` instead of the paged-attention kernel's
  flash-attention pass (``kvflow.attention.cpu_attention.paged_prefill_attention``); read at
  each call, so a test or benchmark can compare the two in one process.
- ``KVFLOW_HUGE_PAGES`` (bool; default on): ``0`` keeps the packed GGUF weights and the
  CPU's paged KV pool out of the huge-page arena (``kvflow.huge_pages``); read at each
  allocation.
- ``KVFLOW_GC_FREEZE`` (bool; default on): ``kvflow serve``'s app, once started, collects and
  freezes the process's heap (``kvflow.utils.freeze_gc_heap``) and unfreezes it when it stops;
  an engine (``LLMEngine``, the offline ``LLM`` too) holds the heap frozen while it has
  requests in flight (``kvflow.utils.hold_gc_freeze``); ``0`` leaves the garbage collector
  alone; read when the app starts and when an engine is made.
- ``KVFLOW_CPU_MALLOC_REUSE`` (byte size; default ``256MiB``): once an engine on the CPU has
  loaded its model, glibc's heap serves blocks up to this size and keeps that much free
  memory for reuse (``kvflow.utils.reuse_large_allocations``), so that a step's large
  tensors are not mapped and page-faulted afresh each step; ``0`` leaves glibc's defaults;
  read when an engine's worker is built.
- ``KVFLOW_CPU_KERNEL_BUILD`` (str; default ``background``): how an engine on the CPU gets
  kernels that are not built yet (``kvflow.ops.build``): ``background`` builds them in a
  background thread while the PyTorch paths serve, and the engine switches to each kernel
  between two steps once it is built; ``wait`` builds each one on its first use, before it
  is needed (the first request waits for it, as before).
- ``KVFLOW_CPU_AUTO_DTYPE`` (str; default unset: detect): what ``dtype="auto"`` means on the
  CPU (``kvflow.platforms.cpu.CpuPlatform.auto_dtype``): unset = bfloat16 where oneDNN runs bfloat16 natively
  (AVX512-BF16 or AMX-BF16), float32 elsewhere; ``float32`` or ``bfloat16`` fixes it.
- ``KVFLOW_CPU_ADAPTIVE_THREADS`` (bool; default on): an engine on the CPU fits its intra-op
  thread count to the cores other processes leave free, between steps
  (``kvflow.cpu_threads.ThreadGovernor``), and ``import kvflow`` sets a short OpenMP spin
  (``GOMP_SPINCOUNT=10000``); ``0`` keeps the configured count and sets
  ``OMP_WAIT_POLICY=PASSIVE`` instead. Read when kvflow is imported and when an engine is made.
- ``KVFLOW_COLLECTIVE_TIMEOUT_S`` (float, seconds; default unset: 600): how long a
  tensor-parallel collective may wait (``EngineArgs.collective_timeout_s`` wins over it).
- ``KVFLOW_QUIET`` (bool; default off): ``1`` is the CLI's ``--quiet``.
- ``KVFLOW_TRACEBACK`` (bool; default off): ``1`` makes the CLI show the traceback of an
  error instead of its one-line message.
- ``KVFLOW_OMP_DEFAULTS`` (bool; default on): ``0`` keeps ``import kvflow`` from setting
  OpenMP's wait policy (``GOMP_SPINCOUNT=10000``, or ``OMP_WAIT_POLICY=PASSIVE`` with
  ``KVFLOW_CPU_ADAPTIVE_THREADS=0``; ``kvflow.cpu_threads``).

Booleans keep the meaning they have always had: a switch that is on by default is turned
off by ``0`` only, one that is off by default is turned on by ``1`` only.

This module must not import torch (``kvflow.cpu_threads`` reads it before torch loads).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Switch:
    """One environment variable.

    Attributes:
        name: the variable.
        type: its type, for the docs ("bool", "str", "path", "float", "int").
        default: what an unset variable means, for the docs.
        effect: what it changes, for the docs.
        parse: the value's text (None when unset) -> the value kvflow uses; raises
            ValueError, naming the variable, for a value it cannot use.
    """

    name: str
    type: str
    default: str
    effect: str
    parse: Callable[[str | None], Any]


def _on_unless_zero(text: str | None) -> bool:
    return text != "0"


def _off_unless_one(text: str | None) -> bool:
    return text == "1"


def _text_or_none(text: str | None) -> str | None:
    return text or None


def _positive_seconds(name: str) -> Callable[[str | None], float | None]:
    def parse(text: str | None) -> float | None:
        if not text:
            return None
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name} must be a positive number of seconds, got {text!r}")
        return value

    return parse


def _choice(name: str, choices: tuple[str, ...], default: str | None) -> Callable[[str | None], str | None]:
    def parse(text: str | None) -> str | None:
        if not text:
            return default
        if text not in choices:
            raise ValueError(f"{name} must be one of {list(choices)}, got {text!r}")
        return text

    return parse


def _byte_size(name: str, default: int) -> Callable[[str | None], int]:
    def parse(text: str | None) -> int:
        from kvflow.utils import parse_bytes

        return default if not text else parse_bytes(text, name)

    return parse


def _kernel_switch(name: str, kernel: str) -> Switch:
    return Switch(name, "bool", "1 (on)",
                  f"`0`: never build kvflow's C++ {kernel} kernel; its PyTorch path runs", _on_unless_zero)


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("KVFLOW_CACHE_DIR", "path", "`~/.cache/kvflow/models`",
           "where GGUF models are converted to and cached as Hugging Face folders "
           "(`EngineArgs.model_cache_dir` / `--model-cache-dir` wins)", _text_or_none),
    Switch("KVFLOW_CPU_MARCH", "str", "`native`",
           "the `-march` target kvflow's C++ CPU kernels are compiled for (e.g. `x86-64-v3`: AVX2, no "
           "AVX-512); a target beyond this CPU is refused, naming the missing features, and one the compiler "
           "does not know, with the compiler's complaint (a warning; the PyTorch paths run)",
           lambda text: text or "native"),
    Switch("KVFLOW_CPU_KERNELS", "bool", "1 (on)",
           "`0`: never build any of kvflow's C++ CPU kernels (all the PyTorch paths run)", _on_unless_zero),
    _kernel_switch("KVFLOW_CPU_ATTENTION", "paged-attention"),
    _kernel_switch("KVFLOW_CPU_NORM", "RMSNorm"),
    _kernel_switch("KVFLOW_CPU_ACTIVATION", "SiLU-and-mul (SwiGLU activation)"),
    _kernel_switch("KVFLOW_CPU_ROTARY", "rotary-embedding"),
    _kernel_switch("KVFLOW_CPU_LINEAR", "weight-only INT8 linear"),
    _kernel_switch("KVFLOW_CPU_INVARIANT_LINEAR", "batch-invariant linear"),
    _kernel_switch("KVFLOW_CPU_GGUF", "GGUF quantized matmul"),
    _kernel_switch("KVFLOW_CPU_FUSED_DECODE", "fused decode-step (all decoder layers in one call; GGUF and dense bfloat16 models)"),
    Switch("KVFLOW_CPU_PREFILL_ATTENTION", "bool", "1 (on)",
           "`0`: prefill chunks on the CPU gather K/V and run PyTorch's `scaled_dot_product_attention` instead "
           "of the paged-attention kernel's flash-attention pass (that kernel's switches still apply)",
           _on_unless_zero),
    Switch("KVFLOW_HUGE_PAGES", "bool", "1 (on)",
           "the packed GGUF weights and the CPU's paged KV pool are placed in memory advised for transparent "
           "huge pages (Linux `madvise(MADV_HUGEPAGE)`; `kvflow.huge_pages`), which streams them faster; `0`: "
           "ordinary allocations", _on_unless_zero),
    Switch("KVFLOW_GC_FREEZE", "bool", "1 (on)",
           "`kvflow serve`, once started, collects and then freezes its process's heap (`gc.freeze()`, as vLLM's "
           "server and engine processes do) so that the garbage collector's full collections no longer scan the "
           "startup objects (a 150-350 ms stall each), and unfreezes it when it stops; an engine (the offline "
           "`LLM` too) freezes the heap (no collection) from its first request in flight to its last one's end, "
           "and unfreezes it then, so that what the caller drops between runs is collected as usual; `0`: "
           "neither", _on_unless_zero),
    Switch("KVFLOW_CPU_MALLOC_REUSE", "byte size", "`256MiB`",
           "once an engine on the CPU has loaded its model, glibc's heap serves and keeps for reuse blocks up to "
           "this size (`mallopt` `M_MMAP_THRESHOLD` / `M_TRIM_THRESHOLD`; `kvflow.utils.reuse_large_allocations`), "
           "so a step's large tensors (the logits: [N, V] float32) are not mapped and page-faulted afresh every "
           "step; `0`: glibc's defaults (blocks above 32 MiB mapped anew each time)",
           _byte_size("KVFLOW_CPU_MALLOC_REUSE", 256 * 2**20)),
    Switch("KVFLOW_CPU_KERNEL_BUILD", "str", "`background`",
           "`background`: an engine builds the C++ CPU kernels it lacks in a background thread while the "
           "PyTorch paths serve, and switches to each between two steps once built; `wait`: each is built on "
           "its first use (the first request waits)", _choice("KVFLOW_CPU_KERNEL_BUILD", ("background", "wait"),
                                                             "background")),
    Switch("KVFLOW_CPU_AUTO_DTYPE", "str", "unset (detect)",
           "what `dtype=\"auto\"` means on the CPU: unset = bfloat16 where oneDNN runs it natively "
           "(AVX512-BF16 or AMX-BF16), else float32; `float32` or `bfloat16` fixes it",
           _choice("KVFLOW_CPU_AUTO_DTYPE", ("float32", "bfloat16"), None)),
    Switch("KVFLOW_CPU_ADAPTIVE_THREADS", "bool", "1 (on)",
           "an engine on the CPU lowers its thread count while other processes want its cores (and raises it "
           "again when they are free; never above the configured count or the CPUs it may use), and `import "
           "kvflow` sets `GOMP_SPINCOUNT=10000`; `0`: the configured thread count always, and "
           "`OMP_WAIT_POLICY=PASSIVE`. Off with tensor parallelism and with OpenMP thread binding", _on_unless_zero),
    Switch("KVFLOW_COLLECTIVE_TIMEOUT_S", "float (seconds)", "unset (600)",
           "how long a tensor-parallel collective waits before failing "
           "(`EngineArgs.collective_timeout_s` / `--collective-timeout-s` wins)",
           _positive_seconds("KVFLOW_COLLECTIVE_TIMEOUT_S")),
    Switch("KVFLOW_QUIET", "bool", "0 (off)", "`1`: the CLI's `--quiet` (no progress messages on stderr)",
           _off_unless_one),
    Switch("KVFLOW_TRACEBACK", "bool", "0 (off)",
           "`1`: the CLI prints an error's traceback instead of its one-line message", _off_unless_one),
    Switch("KVFLOW_OMP_DEFAULTS", "bool", "1 (on)",
           "`0`: `import kvflow` leaves OpenMP's wait policy alone (else it sets `GOMP_SPINCOUNT=10000`, or "
           "`OMP_WAIT_POLICY=PASSIVE` with `KVFLOW_CPU_ADAPTIVE_THREADS=0`, when neither `OMP_WAIT_POLICY` "
           "nor `GOMP_SPINCOUNT` is set)", _on_unless_zero),
)}

EXTERNAL: dict[str, Switch] = {s.name: s for s in (
    Switch("OMP_WAIT_POLICY", "str", "unset", "libgomp's wait policy; when set, kvflow keeps it", _text_or_none),
    Switch("GOMP_SPINCOUNT", "int", "unset", "libgomp's spin count; when set, kvflow keeps the wait policy",
           _text_or_none),
    Switch("OMP_PROC_BIND", "str", "unset", "OpenMP thread binding; set (other than `false`), kvflow's thread "
           "governor stays off", _text_or_none),
    Switch("OMP_PLACES", "str", "unset", "OpenMP places; set, kvflow's thread governor stays off", _text_or_none),
    Switch("GOMP_CPU_AFFINITY", "str", "unset", "libgomp's CPU binding; set, kvflow's thread governor stays off",
           _text_or_none),
    Switch("ONEDNN_MAX_CPU_ISA", "str", "unset (all)", "oneDNN's instruction-set cap; below AVX512_CORE_BF16 "
           "it stops oneDNN's native bfloat16, and `dtype=\"auto\"` means float32 on the CPU", _text_or_none),
    Switch("RANK", "int", "unset", "set by torchrun: this process's tensor-parallel rank", _text_or_none),
    Switch("WORLD_SIZE", "int", "unset", "set by torchrun: the number of tensor-parallel processes",
           _text_or_none),
    Switch("TORCHELASTIC_RUN_ID", "str", "unset", "set by torchrun: kvflow was started by it", _text_or_none),
    Switch("VLLM_API_KEY", "str", "unset", "vLLM's server key: `kvflow serve` takes it when `--api-key` is not "
           "given, as vLLM's server does (empty: no key; blank: a usage error)", _text_or_none),
    Switch("CXX", "path", "`c++`", "the C++ compiler (also PyTorch's) asked which features a "
           "`KVFLOW_CPU_MARCH` target enables", lambda text: text or "c++"),
    Switch("TORCH_EXTENSIONS_DIR", "path", "unset (`<user cache>/torch_extensions/py<version>_<accelerator>`)",
           "where PyTorch builds C++ extensions, and kvflow looks for its cached kernel builds (empty: the "
           "working directory, as PyTorch takes it)", lambda text: text),
)}


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of switch ``name`` in ``environ`` (default ``os.environ``), parsed.

    Raises:
        KeyError: for a name that is in neither ``SWITCHES`` nor ``EXTERNAL``.
        ValueError: naming the variable, for a value it cannot use.
    """
    switch = SWITCHES.get(name) or EXTERNAL[name]
    return switch.parse((os.environ if environ is None else environ).get(name))


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether variable ``name`` (a switch or an external one) is present in the environment."""
    if name not in SWITCHES and name not in EXTERNAL:
        raise KeyError(name)
    return name in (os.environ if environ is None else environ)


def cpu_kernel_enabled(switch: str) -> bool:
    """False when the kernel's own switch or ``KVFLOW_CPU_KERNELS`` is ``0``."""
    return read(switch) and read("KVFLOW_CPU_KERNELS")


def __getattr__(name: str) -> Any:
    if name in SWITCHES:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *SWITCHES])


def markdown_table(switches: Mapping[str, Switch]) -> str:
    """A Markdown table of ``switches``: name, type, default, effect."""
    rows = ["| variable | type | default | effect |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.type} | {s.default} | {s.effect} |" for s in switches.values()]
    return "\n".join(rows)


def markdown() -> str:
    """The text of docs/envs.md: every ``SWITCHES`` and ``EXTERNAL`` variable in a Markdown
    table. Regenerate the file with
    ``python -c 'from kvflow.envs import markdown; print(markdown(), end="")' > docs/envs.md``."""
    return "\n".join([
        "# Environment variables",
        "",
        "<!-- Generated from kvflow/envs.py by markdown(); do not edit by hand. Regenerate with:",
        "python -c 'from kvflow.envs import markdown; print(markdown(), end=\"\")' > docs/envs.md -->",
        "",
        "Every `KVFLOW_*` switch is read in one module, `kvflow/envs.py`, when the part that uses it runs "
        "(a kernel's switches are decided once per process, when the kernel is first asked for). A value "
        "kvflow cannot use is a `ValueError` naming the variable. Booleans keep the meaning they have always "
        "had: a switch that is on by default is turned off by `0` only, one that is off by default is turned "
        "on by `1` only.",
        "",
        markdown_table(SWITCHES),
        "",
        "## Variables of other programs that kvflow reads",
        "",
        "PyTorch's `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`) is where the C++ kernels are "
        "built and cached.",
        "",
        markdown_table(EXTERNAL),
        "",
    ])

