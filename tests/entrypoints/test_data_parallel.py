"""``kvflow serve --data-parallel-size N``: CPU shares, the replicas' and router's command
lines, the endpoints the routers call on a worker, and (with ``vllm-router`` installed) two
replicas of a tiny model behind the real router: affinity, a replica killed under load, its
restart and rejoin."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from conftest import TINY_TEXT_VOCAB, InProcessServer, tiny_engine, tiny_hf_model_dir, tiny_model_config, tiny_tokenizer
from kvflow.entrypoints.cli import build_parser, main
from kvflow.entrypoints.data_parallel import (DataParallelArgs, DataParallelServer, cpu_shares, replica_argv,
                                              router_argv)


# ---------------------------------------------------------------------------- pure parts

def test_cpu_shares():
    assert cpu_shares(2, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert cpu_shares(3, [4, 5, 6, 7, 8]) == [[4, 5], [6, 7], [8]]
    assert cpu_shares(1, [3, 1]) == [[1, 3]]
    assert sorted(sum(cpu_shares(2), [])) == sorted(os.sched_getaffinity(0)) or len(os.sched_getaffinity(0)) < 2
    with pytest.raises(ValueError, match="data_parallel_size"):
        cpu_shares(0, [0])


def test_more_replicas_than_cpus_is_refused():
    """Fewer cores than replicas shared cores ([0], [1], [0]): replicas pinned to one core
    slowed each other down with nothing to say so."""
    with pytest.raises(ValueError, match=r"data_parallel_size 3 is more replicas than the 2 CPUs .*CPUs 4-5\); .*"
                                         r"run at most 2"):
        cpu_shares(3, [4, 5])
    assert cpu_shares(2, [4, 5]) == [[4], [5]]


def _no_replica(monkeypatch):
    from kvflow.engine.llm_engine import LLMEngine

    def never(*args, **kwargs):
        raise AssertionError("a replica started (or the model loaded) before the check")

    monkeypatch.setattr(DataParallelServer, "_start_replica", never)
    monkeypatch.setattr(LLMEngine, "from_engine_args", never)


def test_cli_refuses_more_replicas_than_cpus_before_any_starts(capsys, monkeypatch):
    _no_replica(monkeypatch)
    n = len(os.sched_getaffinity(0))
    with pytest.raises(SystemExit) as exc:
        main(["serve", "smollm2-135m", "--data-parallel-size", str(n + 1), "--port", "18292"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"data_parallel_size {n + 1} is more replicas than the {n} CPUs" in err, err


@pytest.mark.parametrize("router", ["vllm-router", "sglang-router"])
def test_cli_refuses_a_router_not_installed_before_any_replica_starts(capsys, monkeypatch, router):
    """Every replica started and loaded the model (14 s here, minutes for a large model)
    before the missing router package was noticed."""
    from kvflow.entrypoints import data_parallel

    _no_replica(monkeypatch)
    monkeypatch.setitem(data_parallel._ROUTER_MODULES, router, "kvflow_no_such_router.launch_router")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(SystemExit) as exc:
        main(["serve", "smollm2-135m", "--data-parallel-size", "2", "--router", router, "--port", "18293"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--router {router}: the {router} package is not installed" in err, err


@pytest.mark.parametrize("argv, wanted", [
    (["no-such-model"], "Unknown model name 'no-such-model'"),
    (["smollm2-135m", "--max-num-seqs", "0"], "max_num_seqs must be a positive integer, got 0"),
    (["smollm2-135m", "--pipeline-parallel-size", "2"], "pipeline_parallel_size"),
])
def test_cli_refuses_the_engines_bad_options_before_any_replica_starts(capsys, monkeypatch, argv, wanted):
    """Every replica started, printed the same error and exited 2, then the command exited 1
    ("replica 1 ... exited with status 2 while starting"): docs/scale-out.md says the
    server's own bad flags are refused (exit 2) before any replica starts."""
    _no_replica(monkeypatch)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv, "--data-parallel-size", "2", "--port", "18294"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and wanted in err, err


def test_cli_refuses_replicas_whose_kv_pools_do_not_fit_together(capsys, monkeypatch):
    """Each replica checked its own KV pool against the available memory, which the others
    were about to take: two 64 MiB pools with 100 MiB available both passed and both
    allocated. The command checks the replicas' pools together (exit 2); one of them fits."""
    import collections

    import psutil

    _no_replica(monkeypatch)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    mem = collections.namedtuple("mem", "available total")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: mem(available=100 * 2**20, total=2**34))
    with pytest.raises(SystemExit) as exc:
        main(["serve", "smollm2-135m", "--kv-cache-memory-bytes", "64MiB", "--data-parallel-size", "2",
              "--port", "18295"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "kv_cache_memory_bytes=67108864" in err and "in each of 2 replicas" in err, err
    from kvflow.engine.arg_utils import EngineArgs

    assert EngineArgs(model="smollm2-135m", kv_cache_memory_bytes="64MiB").create_config().cache.num_blocks > 0


def test_replica_argv_overrides_the_command():
    argv = ["serve", "smollm2-135m", "--data-parallel-size", "4", "--port", "9000", "--host", "0.0.0.0",
            "--num-threads", "8", "--block-size", "32"]
    args = build_parser().parse_args(replica_argv(argv, 12345, 2))
    assert (args.data_parallel_size, args.port, args.host, args.num_threads) == (1, 12345, "127.0.0.1", 2)
    assert args.block_size == 32 and args.model_tag == "smollm2-135m"
    # The router's flags stay with the router: one engine refuses them (they would do nothing).
    argv += ["--router", "sglang-router", "--router-policy=round_robin", "--seed", "3"]
    replica = replica_argv(argv, 12345, 2)
    assert not any(a.startswith("--router") or a in ("sglang-router", "round_robin") for a in replica), replica
    assert build_parser().parse_args(replica).seed == 3


def test_router_argv_and_validation():
    pytest.importorskip("vllm_router")
    argv = router_argv("vllm-router", "0.0.0.0", 8000, ["http://127.0.0.1:1", "http://127.0.0.1:2"], "round_robin", 29001)
    assert argv[1:3] == ["-m", "vllm_router.launch_router"]
    i = argv.index("--worker-urls")
    assert argv[i + 1:i + 3] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert argv[argv.index("--policy") + 1] == "round_robin" and argv[argv.index("--port") + 1] == "8000"
    with pytest.raises(ValueError, match="router"):
        router_argv("nginx", "h", 1, [], "cache_aware", 2)
    for bad, field in [((0,), "data_parallel_size"), ((2, "haproxy"), "router"), ((2, "vllm-router", "lru"), "router_policy")]:
        with pytest.raises(ValueError, match=field):
            DataParallelArgs(*bad).validate()


def test_the_routers_url_brackets_an_ipv6_host(monkeypatch):
    """--host ::1 printed "replicas behind vllm-router ... on http://::1:8708" (not a URL a
    client can use) and polled the router's /health at that string."""
    from kvflow.entrypoints import data_parallel

    monkeypatch.setattr(data_parallel, "check_router_installed", lambda router: "vllm_router.launch_router")
    assert DataParallelServer(["serve"], 1, host="::1", port=8000, cpus=[0]).url == "http://[::1]:8000"
    assert DataParallelServer(["serve"], 1, host="127.0.0.1", port=8000, cpus=[0]).url == "http://127.0.0.1:8000"


def test_cli_refuses_a_bad_size(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "smollm2-135m", "--data-parallel-size", "0"])
    assert exc.value.code == 2 and "data_parallel_size must be an integer >= 1" in capsys.readouterr().err


# ---------------------------------------------------------------------------- worker endpoints

@pytest.fixture(scope="module")
def tiny_server():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = tiny_engine(tokenizer=tiny_tokenizer(), config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB),
                         block_size=4, num_blocks=96)
    s = InProcessServer(engine)
    yield s
    s.stop()
    torch.set_num_threads(saved)


def test_router_endpoints_answer_from_the_engine(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as http:
        info = http.get("/get_server_info").json()
        assert (info["block_size"], info["num_gpu_blocks"], info["served_model_name"]) == (4, 96, "tiny")
        assert info["enable_prefix_caching"] is True and info["max_model_len"] == 256
        assert http.get("/get_model_info").json()["is_generation"] is True
        load = http.get("/get_load").json()
        assert load["load"] == load["num_reqs"] + load["num_waiting_reqs"] == 0, load

        # a request in flight is counted (a long one, streamed: read its first chunk, then look)
        body = {"model": "tiny", "prompt": "count with me " * 4, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            busy = http.get("/get_load").json()
            assert busy["num_reqs"] + busy["num_waiting_reqs"] == 1 and busy["num_tokens"] > 0, busy
            for _ in lines:
                pass

        prompt = {"model": "tiny", "prompt": "flush me please, I am a prompt of some length", "max_tokens": 1}
        http.post("/v1/completions", json=prompt)
        warm = http.post("/v1/completions", json=prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert warm > 0
        r = http.post("/flush_cache")
        assert r.status_code == 200, r.text
        cold = http.post("/v1/completions", json=prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cold == 0


# ---------------------------------------------------------------------------- behind vllm-router

@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    pytest.importorskip("vllm_router", reason="pip install 'kvflow[scale-out]' (vllm-router)")
    model = tiny_hf_model_dir(tmp_path_factory.mktemp("tiny"))
    env = {**os.environ, "KVFLOW_CPU_KERNELS": "0"}  # no kernel build in the replicas
    dp = DataParallelServer(["serve", str(model), "--block-size", "4", "--log-level", "warning", "--dtype", "float32"],
                            2, port=_free(), num_threads=1, env=env)
    dp.start(timeout_s=240)
    yield dp
    dp.stop()
    for r in dp.replicas:
        assert r.process is None or r.process.poll() is not None
    assert dp.router_process.poll() is not None


def _free() -> int:
    from kvflow.entrypoints.data_parallel import free_port

    return free_port()


def _tenant_prompt(t: int) -> str:
    """A system prompt of its own per tenant (the router matches text: no shared words)."""
    return "".join(hashlib.sha256(f"{t}-{i}".encode()).hexdigest() for i in range(3)) + " "


def _served(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvflow:request_success_total{"))


def test_openai_sdk_through_the_router_and_prefix_affinity(replicas):
    import openai

    client = openai.OpenAI(base_url=replicas.url + "/v1", api_key="none", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    tenants = [_tenant_prompt(t) for t in range(4)]
    before = [_served(r.url) for r in replicas.replicas]
    for rnd in range(3):
        for t, system in enumerate(tenants):
            r = client.completions.create(model=model, prompt=system + f"question {rnd}", max_tokens=2)
            if rnd > 0:  # the router sent it where its prefix is cached
                assert r.usage.prompt_tokens_details.cached_tokens >= len(system) - 8, (t, rnd, r.usage)
    served = [_served(r.url) - b for r, b in zip(replicas.replicas, before)]
    assert sum(served) == 12, served
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].finish_reason == "length"


@pytest.fixture()
def round_robin(replicas):
    """A second router, round-robin, over the same replicas (so that both get requests)."""
    import subprocess

    from kvflow.entrypoints.data_parallel import _child_setup, http_ok

    port = _free()
    proc = subprocess.Popen(router_argv("vllm-router", "127.0.0.1", port, [r.url for r in replicas.replicas],
                                        "round_robin", _free()), preexec_fn=_child_setup(None),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not http_ok(url + "/health"):
        assert proc.poll() is None and time.monotonic() < deadline, "the round-robin router did not start"
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(30)


def test_kill_a_replica_under_load(replicas, round_robin):
    """A replica killed mid-load: the others finish theirs, the killed one's requests fail
    with an error (or are retried), nothing hangs; the router stops sending to it; the
    supervisor restarts it and the router sends to it again."""
    victim, survivor = replicas.replicas
    router = round_robin
    model = httpx.get(router + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 200, "ignore_eos": True}

    def one(i: int) -> tuple[int, str]:
        try:
            r = httpx.post(router + "/v1/completions", json={**body, "prompt": f"load {i} " * (i + 1)},
                           timeout=90)
            return r.status_code, r.text[:300]
        except httpx.HTTPError as exc:  # the client must not hang: a bounded read
            return -1, f"{type(exc).__name__}: {exc}"

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        deadline = time.monotonic() + 60
        while True:  # every request is on a replica: kill the victim with its share in flight
            loads = [httpx.get(r.url + "/get_load", timeout=10).json()["load"] for r in (victim, survivor)]
            if sum(loads) == 8 and loads[0] > 0:
                break
            assert time.monotonic() < deadline, f"the requests did not reach both replicas: {loads}"
            time.sleep(0.02)
        os.kill(victim.process.pid, signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]  # nothing hangs
    ok = [r for r in results if r[0] == 200]
    failed = [r for r in results if r[0] != 200]
    for status, text in failed:  # a clear error, not a hang or an empty reply
        assert status >= 500 or status == -1, (status, text)
        assert text, status
    # only the killed replica's requests may fail; the survivor's all finished
    assert len(failed) <= loads[0] and len(ok) >= loads[1], (loads, results)

    # reported and restarted by the supervisor (one check pass), then healthy again
    assert replicas.check() is None and victim.restarts == 1
    deadline = time.monotonic() + 120
    while not _healthy(victim.url):
        assert time.monotonic() < deadline and victim.process.poll() is None, "the replica did not come back"
        time.sleep(0.2)
    # after the restart the router's health check sees it again: requests reach it
    deadline = time.monotonic() + 60
    while _served(victim.url) == 0:
        assert time.monotonic() < deadline, "the router did not send to the restarted replica"
        r = httpx.post(router + "/v1/completions", json={**body, "max_tokens": 1,
                                                                 "prompt": f"rejoin {time.monotonic()}"}, timeout=60)
        assert r.status_code == 200, r.text
    # and while it was gone every request the router accepted went to the survivor
    assert all(httpx.post(router + "/v1/completions", json={**body, "max_tokens": 1, "prompt": f"after {i}"},
                          timeout=60).status_code == 200 for i in range(4))


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
