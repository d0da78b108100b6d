"""Prometheus metrics of the serving engine, named as vLLM users know them (prefix ``kvflow:``).

Latencies are in seconds; token counters in tokens. Each server owns its own
``CollectorRegistry`` so that several engines can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: The ``finished_reason`` labels of ``request_success_total`` (vLLM's, less "error": a failed
#: request is counted by ``request_failure_total``).
FINISHED_REASONS = ("stop", "length", "abort")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    """The metric objects, registered in ``self.registry``."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kvflow:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvflow:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"kvflow:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        # prometheus_client appends _total to counter names itself.
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache.")
        self.kv_window_freed_blocks = counter(
            "kv_window_freed_blocks", "KV blocks (pages of a hybrid cache) returned to the pool behind a sliding window.")
        self.cpu_threads = gauge("cpu_threads", "CPU intra-op threads the engine runs now (its thread governor's choice).")
        self.cpu_other_load = gauge(
            "cpu_other_load", "CPU cores other processes wanted on the engine's CPUs, last measurement (thread governor).")
        self.cpu_thread_changes = counter(
            "cpu_thread_changes", "Times the thread governor changed the engine's CPU intra-op thread count.")
        # by finish reason, as vLLM's vllm:request_success_total{finished_reason=...}
        success = Counter("kvflow:request_success", "Requests finished, by finish reason (stop, length, abort: the "
                          "client went away or aborted it).", [*labels, "finished_reason"], registry=r)
        self._request_success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self.request_failure = counter("request_failure", "Requests the engine failed alone (an error inside the engine).")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding).")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted (speculative decoding).")
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token, seconds.")
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between output tokens, seconds.")
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish, seconds.")
        self.request_queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled, seconds.")
        self._last_stats: dict[str, float] = {}

    def request_finished(self, finish_reason: str | None) -> None:
        """Count one finished request under its finish reason (an unknown one as "stop")."""
        self._request_success.get(finish_reason, self._request_success["stop"]).inc()

    def update_engine_stats(self, stats: dict[str, float]) -> None:
        """Set the gauges and advance the counters from ``LLMEngine.get_stats()`` (the
        speculative-decoding counters stay 0 without a proposer)."""
        self.num_requests_running.set(stats["num_running"])
        self.num_requests_waiting.set(stats["num_waiting"])
        self.kv_cache_usage_perc.set(stats["kv_cache_usage"])
        if "num_cpu_threads" in stats:
            self.cpu_threads.set(stats["num_cpu_threads"])
            self.cpu_other_load.set(stats["cpu_other_load"])
        for key, counter in (
            ("num_preemptions", self.num_preemptions),
            ("prefix_cache_queries", self.prefix_cache_queries),
            ("prefix_cache_hits", self.prefix_cache_hits),
            ("num_window_freed_blocks", self.kv_window_freed_blocks),
            ("num_cpu_thread_changes", self.cpu_thread_changes),
            ("spec_num_draft_tokens", self.spec_decode_num_draft_tokens),
            ("spec_num_accepted_tokens", self.spec_decode_num_accepted_tokens),
        ):
            delta = stats.get(key, 0) - self._last_stats.get(key, 0)
            if delta > 0:
                counter.inc(delta)
        self._last_stats = dict(stats)
