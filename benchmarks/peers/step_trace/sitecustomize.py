"""Per-step trace of an engine's scheduler, for comparing kvflow's and vLLM's schedules.

Put this folder first on ``PYTHONPATH`` and set ``STEP_TRACE=<prefix>``: every Python process
that then imports kvflow's or vLLM's (v1) scheduler module writes one JSON line per engine
step to ``<prefix>.<pid>.jsonl``, without changing what the engine does. The scheduler class
is patched as its module finishes importing (an import hook), so this works in vLLM's engine
core process too, whatever way it is started. Both schedulers share the names used here:
``Scheduler.schedule()`` returns an output with ``num_scheduled_tokens`` (request id ->
tokens, in batch order) and ``self.requests`` (id -> request with ``num_computed_tokens`` and
``num_prompt_tokens``); a step ends in ``update`` (kvflow) / ``update_from_output`` (vLLM).

Fields of a line: ``t0`` (schedule entry, ``time.monotonic()`` seconds), ``sched_s`` (the
schedule call), ``step_s`` (schedule entry to update exit: the model's forward, sampling and
the update), ``tokens`` (scheduled tokens), ``prefill_tokens`` / ``decode_tokens``,
``prefill_reqs`` / ``decode_reqs``, ``first_chunks`` (requests whose first prompt chunk this
is), ``partial`` (prefill chunks that leave prompt tokens for later steps), ``order`` (the
batch's requests in order, ``p`` prefill / ``d`` decode), ``waiting`` / ``running`` (queue
lengths after scheduling). Read a trace with ``python -m benchmarks.peers.step_report``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

_TARGETS = {"kvflow.core.scheduler": "update", "vllm.v1.core.sched.scheduler": "update_from_output"}


def _patch(module) -> None:
    cls = module.Scheduler
    update_name = _TARGETS[module.__name__]
    schedule, update = cls.schedule, getattr(cls, update_name)
    path = f"{os.environ['STEP_TRACE']}.{os.getpid()}.jsonl"
    sink = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    pending: dict[int, dict] = {}

    def traced_schedule(self, *args, **kwargs):
        before = {rid: r.num_computed_tokens for rid, r in self.requests.items()}
        t0 = time.monotonic()
        out = schedule(self, *args, **kwargs)
        t1 = time.monotonic()
        rec = dict(t0=t0, sched_s=t1 - t0, tokens=0, prefill_tokens=0, decode_tokens=0, prefill_reqs=0,
                   decode_reqs=0, first_chunks=0, partial=0, order="",
                   waiting=len(self.waiting), running=len(self.running))
        order = []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            done = before.get(rid, 0)
            prompt = req.num_prompt_tokens
            rec["tokens"] += n
            if done < prompt:
                p = min(done + n, prompt) - done
                rec["prefill_tokens"] += p
                rec["decode_tokens"] += n - p
                rec["prefill_reqs"] += 1
                rec["first_chunks"] += done == 0 or rid not in before
                rec["partial"] += done + n < prompt
                order.append("p")
            else:
                rec["decode_tokens"] += n
                rec["decode_reqs"] += 1
                order.append("d")
        rec["order"] = "".join(order)
        pending[id(out)] = rec
        return out

    def traced_update(self, out, *args, **kwargs):
        result = update(self, out, *args, **kwargs)
        rec = pending.pop(id(out), None)
        if rec is not None and rec["tokens"]:
            rec["step_s"] = time.monotonic() - rec["t0"]
            sink.write(json.dumps(rec) + "\n")
        return result

    cls.schedule = traced_schedule
    setattr(cls, update_name, traced_update)


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


if os.environ.get("STEP_TRACE"):
    import importlib.util

    sys.meta_path.insert(0, _Hook())
