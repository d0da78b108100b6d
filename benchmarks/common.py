"""Shared pieces of the kvflow benchmarks: a real-text workload, machine facts, a text table.

The workload takes token windows from two license texts present on every Debian machine
(``/usr/share/common-licenses/GPL-3`` and ``Apache-2.0``), tokenized with the model's own
tokenizer, so prompts are real text of controlled length without any network access.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import kvflow  # noqa: F401 - before torch: kvflow's OpenMP wait policy applies (kvflow.cpu_threads)
import torch

TEXT_FILES = (
    Path("/usr/share/common-licenses/GPL-3"),
    Path("/usr/share/common-licenses/Apache-2.0"),
)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a benchmark workload.

    Attributes:
        prompt_token_ids: the prompt, a window of real text.
        output_len: exact number of tokens to generate (generation ignores EOS).
        source: which text file the window comes from (file name).
        offset: index of the window's first token in that file's token ids.
    """

    prompt_token_ids: list[int]
    output_len: int
    source: str
    offset: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def tokenize_corpus(tokenizer: Any, files: tuple[Path, ...] = TEXT_FILES) -> dict[str, list[int]]:
    """Token ids of each text file (no special tokens), keyed by file name.

    Raises:
        FileNotFoundError: when a text file is missing.
    """
    corpus = {}
    for path in files:
        text = path.read_text(encoding="utf-8")
        corpus[path.name] = tokenizer.encode(text, add_special_tokens=False)
    return corpus


def make_workload(
    tokenizer: Any,
    num_prompts: int,
    seed: int,
    prompt_len_range: tuple[int, int] = (16, 512),
    output_len_range: tuple[int, int] = (16, 256),
) -> list[BenchRequest]:
    """``num_prompts`` requests with prompt and output lengths uniform in the given ranges
    (inclusive, in tokens), prompts cut from a random text file at a random offset.

    The same ``seed`` and tokenizer give the same workload.

    Raises:
        ValueError: when a text file is shorter than the longest prompt asked for.
    """
    corpus = tokenize_corpus(tokenizer)
    lo, hi = prompt_len_range
    for name, ids in corpus.items():
        if len(ids) < hi:
            raise ValueError(f"{name} has {len(ids)} tokens, fewer than the longest prompt ({hi})")
    rng = random.Random(seed)
    names = sorted(corpus)
    requests = []
    for _ in range(num_prompts):
        prompt_len = rng.randint(lo, hi)
        output_len = rng.randint(*output_len_range)
        name = rng.choice(names)
        ids = corpus[name]
        offset = rng.randint(0, len(ids) - prompt_len)
        requests.append(BenchRequest(ids[offset : offset + prompt_len], output_len, name, offset))
    return requests


def workload_summary(requests: list[BenchRequest]) -> dict[str, Any]:
    """Counts and length statistics of a workload, in tokens."""
    p = [r.prompt_len for r in requests]
    o = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(p),
        "output_tokens": sum(o),
        "prompt_len_min": min(p),
        "prompt_len_mean": sum(p) / len(p),
        "prompt_len_max": max(p),
        "output_len_min": min(o),
        "output_len_mean": sum(o) / len(o),
        "output_len_max": max(o),
        "sources": {name: sum(r.source == name for r in requests) for name in sorted({r.source for r in requests})},
    }


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "amx_tile", "amx_int8", "amx_bf16")
ISA_CAPS = ("KVFLOW_CPU_MARCH", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "KVFLOW_CPU_KERNELS")


def cpu_isa() -> list[str]:
    """The vector-ISA flags of /proc/cpuinfo that kvflow's kernels and its peers' pick from
    (``ISA_FLAGS``, in that order), or [] where the file is not there."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


def isa_caps() -> dict[str, str]:
    """The environment variables that cap the ISA below the CPU's (the test command's AVX2
    pass sets the first three), as set for this process."""
    return {k: os.environ[k] for k in ISA_CAPS if k in os.environ}


def machine_info() -> dict[str, Any]:
    """Versions, thread counts and the date, for the JSON record of a run."""
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:  # pragma: no cover - only when the HF baseline is skipped
        transformers_version = None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers_version,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model(),
        "cpu_isa": cpu_isa(),
        "isa_caps": isa_caps(),
        "cuda_available": torch.cuda.is_available(),
    }


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain monospace table; floats get 2 decimals (3 significant digits below 10)."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
        return "-" if v is None else str(v)

    cells = [headers] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def request_dicts(requests: list[BenchRequest]) -> list[dict[str, Any]]:
    """Per-request lengths and origins for the JSON record (without the token ids)."""
    out = []
    for r in requests:
        d = asdict(r)
        d.pop("prompt_token_ids")
        d["prompt_len"] = r.prompt_len
        out.append(d)
    return out


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat (Linux), or None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_busy_fraction(interval_s: float = 1.0) -> float | None:
    """Fraction (0-1) of all CPUs busy over ``interval_s`` seconds, whoever runs.

    Other containers on the same VM do not show in ``ps`` but do show here; call this
    while the benchmark itself is idle to see whether the machine is shared right now.
    """
    import time

    a = _cpu_jiffies()
    time.sleep(interval_s)
    b = _cpu_jiffies()
    if a is None or b is None or b[1] == a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


def wait_for_idle(max_wait_s: float, threshold: float = 0.1, interval_s: float = 2.0) -> float | None:
    """Wait up to ``max_wait_s`` seconds until the CPUs are less than ``threshold`` busy.

    Returns:
        The last busy fraction measured (None where /proc/stat is unavailable).
    """
    import time

    deadline = time.monotonic() + max_wait_s
    busy = cpu_busy_fraction(interval_s)
    while busy is not None and busy >= threshold and time.monotonic() < deadline:
        busy = cpu_busy_fraction(interval_s)
    return busy


class OtherLoad:
    """How many CPU cores other processes (any container on the VM) kept busy during a phase.

    Use as a context manager around a timed phase; ``cores`` is then
    (all CPUs' busy time - this process's CPU time) / wall time. Near 0 means the phase had
    the machine to itself; 1 on a 2-core machine means another job took a core and the
    phase's numbers are not trustworthy.
    """

    def __init__(self) -> None:
        self.cores: float | None = None
        self.own_cpu_s: float | None = None  # this process's CPU time in the phase, all threads

    def __enter__(self) -> "OtherLoad":
        import time

        self._j = _cpu_jiffies()
        self._p = time.process_time()
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        import time

        j = _cpu_jiffies()
        wall = time.perf_counter() - self._t
        self.own_cpu_s = time.process_time() - self._p
        if j is None or self._j is None or wall <= 0:
            return
        hz = os.sysconf("SC_CLK_TCK")
        busy_s = (j[0] - self._j[0]) / hz
        self.cores = max(0.0, (busy_s - self.own_cpu_s) / wall)
