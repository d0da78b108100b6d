"""benchmarks/gguf_kernels.py --profile-decode: the fused step's call as a profiler range and
the per-step wall times."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

from benchmarks.gguf_kernels import _step_times, _TimedDecoder


def test_timed_decoder_records_forward_and_passes_the_rest_through():
    names = []

    @contextlib.contextmanager
    def record(name):
        names.append(name)
        yield

    inner = SimpleNamespace(forward=lambda *a: sum(a), num_layers=lambda: 3, set_kv_caches=lambda k, v: (k, v))
    timed = _TimedDecoder(inner, record)
    assert timed.forward(1, 2, 3) == 6 and names == [_TimedDecoder.NAME]
    assert timed.num_layers() == 3 and timed.set_kv_caches("k", "v") == ("k", "v") and names == [_TimedDecoder.NAME]


class _Runner:
    def __init__(self, delays):
        self.delays = list(delays)

    def execute(self, out):
        time.sleep(self.delays.pop(0))
        return out


def test_step_times_time_each_engine_step_and_restore_execute():
    runner = _Runner([0.001, 0.001, 0.05, 0.001])

    def generate(prompts, params, use_tqdm=False):
        assert params.max_tokens == 4
        for i in range(4):
            runner.execute(i)

    llm = SimpleNamespace(engine=SimpleNamespace(model_runner=runner), generate=generate)
    st = _step_times(llm, "p", 4)
    assert st["steps"] == 4 and len(st["all_ms"]) == 4
    assert st["slowest"][0][0] == 2 and st["max_ms"] >= 50 and st["median_ms"] < 50
    assert "execute" not in runner.__dict__  # the class's method again
