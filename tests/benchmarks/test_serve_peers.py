"""benchmarks/serve_peers.py: the command lines it starts and the tables it prints (the runs
themselves need the peers installed and an idle machine; see docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import serve_peers
from kvflow.entrypoints.cli import build_parser


def test_server_commands_use_the_same_threads_and_dtype() -> None:
    args = serve_peers.parse_args(["--engines", "kvflow,kvflow-int4,vllm,llama-server", "--threads", "3",
                                   "--scenarios", "single,concurrent32", "--vllm", "/opt/vllm.sh --x"])  # fmt: skip
    hf, gguf = Path("/m/hf"), Path("/m/model.gguf")
    kv = serve_peers.server_command("kvflow", args, hf, gguf, 9000, 32)
    assert kv[kv.index("--dtype") + 1] == "bfloat16" and kv[kv.index("--num-threads") + 1] == "3"
    assert kv[kv.index("--quantization") + 1] == "none"  # the file dequantized (kvflow-default: as stored)
    int4 = serve_peers.server_command("kvflow-int4", args, hf, gguf, 9000, 32)
    assert int4[int4.index("--quantization") + 1] == "int4" and int4[int4.index("--lm-head-quantization") + 1] == "int8"
    for cmd in (kv, int4):  # kvflow's own CLI parser takes them (it exits 2 on an unknown flag or value)
        parsed = build_parser().parse_args(cmd[cmd.index("serve"):])
        assert parsed.num_threads == 3 and parsed.dtype == "bfloat16"
    assert parsed.quantization == "int4" and parsed.quantize_lm_head == "int8"
    vllm = serve_peers.server_command("vllm", args, hf, gguf, 9000, 32)
    assert vllm[:4] == ["/opt/vllm.sh", "--x", "serve", "/m/hf"] and vllm[vllm.index("--dtype") + 1] == "bfloat16"
    llama = serve_peers.server_command("llama-server", args, hf, gguf, 9000, 32)
    assert llama[llama.index("-m") + 1] == "/m/model.gguf" and llama[llama.index("-np") + 1] == "32"
    assert llama[llama.index("-c") + 1] == str(32 * 1024) and llama[llama.index("-t") + 1] == "3"
    with pytest.raises(ValueError, match="GGUF"):
        serve_peers.server_command("llama-server", args, hf, None, 9000, 32)


@pytest.mark.parametrize("flag, value", [("--engines", "kvflow,sglang"), ("--scenarios", "burst")])
def test_unknown_engine_or_scenario_is_refused(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        serve_peers.parse_args([flag, value])
    assert value.split(",")[-1] in capsys.readouterr().err


def test_table_ratios_are_relative_to_the_first_engine() -> None:
    result = {"completed": 4, "failed": 0, "output_throughput": 50.0, "mean_ttft_ms": 100.0, "p99_ttft_ms": 120.0,
              "mean_tpot_ms": 20.0, "p99_tpot_ms": 25.0, "p99_itl_ms": 30.0, "other_load_cores": 0.05,
              "bench_cpu_cores": 0.3, "cpu_thread_changes": 2.0}  # fmt: skip
    faster = dict(result, output_throughput=75.0, mean_ttft_ms=50.0, cpu_thread_changes=None)
    records = [{"engine": "kvflow", "scenarios": {"single": result}}, {"engine": "vllm", "scenarios": {"single": faster}},
               {"engine": "llama-server", "error": "did not start"}]  # fmt: skip
    text = serve_peers.tables(records, ["single"])
    vllm_row = next(line for line in text.splitlines() if line.startswith("vllm"))
    assert vllm_row.split()[-6:] == ["1.5", "0.5", "-", "0.05", "0.3", "-"]
    assert next(line for line in text.splitlines() if line.startswith("kvflow")).split()[-1] == "2"
    assert next(line for line in text.splitlines() if line.startswith("llama-server")).split()[1:] == ["-"] * 14


def test_kvflow_default_passes_no_dtype_or_quantization() -> None:
    args = serve_peers.parse_args(["--engines", "kvflow-default", "--scenarios", "concurrent4"])
    cmd = serve_peers.server_command("kvflow-default", args, Path("/m/hf"), None, 9000, 4)
    assert "--dtype" not in cmd and "--quantization" not in cmd and cmd[cmd.index("--model") + 1] == "smollm2-135m"


def test_background_load_spins_until_stopped() -> None:
    import time

    import psutil

    load = serve_peers.BackgroundLoad(1)
    try:
        (proc,) = load.procs
        cpu0 = psutil.Process(proc.pid).cpu_times().user
        time.sleep(0.5)
        assert psutil.Process(proc.pid).cpu_times().user > cpu0  # it runs
        assert serve_peers._tree_rss_mib(proc.pid) > 1.0
    finally:
        load.stop()
    assert proc.poll() is not None
    assert serve_peers._tree_rss_mib(proc.pid) == 0.0


def test_each_scenario_draws_its_own_prompts(tmp_path: Path) -> None:
    """Scenarios run back to back on one server: with one seed, a later scenario resent the same
    prompts and measured the prefix cache."""
    args = serve_peers.parse_args(["--seed", "5"])
    seeds = []
    for scenario in serve_peers.SCENARIOS:
        cmd = serve_peers.bench_command(args, "http://x", Path("/m/hf"), scenario, tmp_path, "r.json")
        seeds.append(int(cmd[cmd.index("--seed") + 1]))
    assert seeds[0] == 5 and len(set(seeds)) == len(serve_peers.SCENARIOS)


def test_variant_runs_an_engine_with_extra_server_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    args = serve_peers.parse_args(["--engines", "kvflow-default,nobound",
                                   "--variant", "nobound=kvflow-default:--max-step-seconds 0"])  # fmt: skip
    cmd = serve_peers.server_command("nobound", args, Path("/m/hf"), None, 9000, 16)
    assert cmd[-2:] == ["--max-step-seconds", "0"] and "--dtype" not in cmd
    assert build_parser().parse_args(cmd[cmd.index("serve"):]).max_step_seconds == 0
    for bad in ("nobound=sglang:--x", "kvflow=kvflow-default:--x", "nobound"):
        with pytest.raises(SystemExit):
            serve_peers.parse_args(["--variant", bad])
        assert "--variant" in capsys.readouterr().err


def test_a_scenario_listed_twice_runs_again_under_its_own_key(tmp_path: Path) -> None:
    args = serve_peers.parse_args(["--scenarios", "concurrent16,single,concurrent16"])
    keys = serve_peers.run_keys(args.scenarios)
    assert keys == ["concurrent16", "single", "concurrent16#2"]
    result = {"completed": 4, "failed": 0, "output_throughput": 50.0, "mean_ttft_ms": 100.0, "other_load_cores": 0.0}
    text = serve_peers.tables([{"engine": "kvflow", "scenarios": {k: result for k in keys}}], keys)
    assert text.count("concurrent16#2 ({") == 1 and text.count("\nkvflow ") == 3
    first, again = (serve_peers.bench_command(args, "u", Path("/m"), "concurrent16", tmp_path, "r") for _ in range(2))
    assert first == again  # the same prompts (seed) again


def test_kvflow_and_llama_server_get_the_same_kv_capacity() -> None:
    """kvflow's --num-kv-blocks x 16-token blocks == llama-server's -c (unified KV, -kvu)."""
    for argv, conc, tokens in ((["--scenarios", "single,prefill512"], 1, 4096),
                               (["--scenarios", "concurrent16"], 16, 16384),
                               (["--scenarios", "single", "--kv-tokens", "1000"], 1, 1000)):  # fmt: skip
        args = serve_peers.parse_args(["--engines", "kvflow-default,llama-server", *argv])
        kv = serve_peers.server_command("kvflow-default", args, Path("/m/hf"), Path("/m/x.gguf"), 9000, conc)
        llama = serve_peers.server_command("llama-server", args, Path("/m/hf"), Path("/m/x.gguf"), 9000, conc)
        blocks = int(kv[kv.index("--num-kv-blocks") + 1])
        assert int(llama[llama.index("-c") + 1]) == tokens and "-kvu" in llama
        assert tokens <= blocks * serve_peers.KV_BLOCK_SIZE < tokens + serve_peers.KV_BLOCK_SIZE
        assert build_parser().parse_args(kv[kv.index("serve"):]).num_kv_blocks == blocks
        assert kv[kv.index("--model") + 1] == "/m/x.gguf"  # the file llama-server reads
    with pytest.raises(SystemExit):
        serve_peers.parse_args(["--kv-tokens", "8"])


def test_prefill512_is_one_512_token_prompt_at_a_time(tmp_path: Path) -> None:
    args = serve_peers.parse_args(["--scenarios", "prefill512"])
    cmd = serve_peers.bench_command(args, "http://x", Path("/m/hf"), "prefill512", tmp_path, "r.json")
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert (flag("--random-input-len"), flag("--random-range-ratio"), flag("--max-concurrency")) == ("512", "0.0", "1")
    assert int(flag("--random-output-len")) <= 8


def test_starts_use_an_empty_model_cache_and_the_summary_flags_weights(tmp_path: Path) -> None:
    args = serve_peers.parse_args(["--engines", "kvflow-default,llama-server", "--scenarios", "single"])
    args.model_cache_dir = tmp_path / "cold"
    kv = serve_peers.server_command("kvflow-default", args, Path("/m/hf"), Path("/m/x.gguf"), 9000, 1)
    assert kv[kv.index("--model-cache-dir") + 1] == str(tmp_path / "cold")
    assert build_parser().parse_args(kv[kv.index("serve"):]).model_cache_dir == str(tmp_path / "cold")
    folder = tmp_path / "cold" / "m-123"
    folder.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (folder / name).write_text("{}")
    files = serve_peers.cache_files(tmp_path / "cold")
    assert serve_peers.weights_in_cache(files) == ["m-123/model.safetensors"]
    scenario = {"output_throughput": 10.0, "mean_ttft_ms": 100.0}
    records = [{"engine": "kvflow-default", "kv_tokens": 4096, "peak_rss_mib": 1100.0,
                "starts": {"cold": {"ready_s": 3.0, "first_token_s": 4.0}, "warm": {"first_token_s": 2.0},
                           "cache_files": files},
                "scenarios": {"single": dict(scenario, output_throughput=12.0), "prefill512": scenario}},
               {"engine": "llama-server", "kv_tokens": 4096, "peak_rss_mib": 1000.0,
                "starts": {"cold": {"ready_s": 1.0, "first_token_s": 2.0}, "warm": {"first_token_s": 1.0}},
                "scenarios": {"single": scenario, "prefill512": dict(scenario, mean_ttft_ms=50.0)}}]  # fmt: skip
    row = next(line for line in serve_peers.summary(records).splitlines() if line.startswith("kvflow-default"))
    assert row.split()[1:] == ["4096", "3", "4", "2", "1100.0", "12.0", "-", "-", "100.0", "1",
                               "2", "1.1", "1.2", "2"]  # fmt: skip


def test_baseline_runs_each_kvflow_engine_from_the_other_checkout(tmp_path: Path) -> None:
    base = tmp_path / "base"
    (base / "kvflow").mkdir(parents=True)
    (base / "kvflow" / "__init__.py").write_text("")
    args = serve_peers.parse_args(["--engines", "kvflow-default,llama-server", "--baseline", str(base)])
    assert args.engines == ["kvflow-default@base", "kvflow-default", "llama-server"]
    assert serve_peers.server_env("kvflow-default@base", args)["PYTHONPATH"].split(os.pathsep)[0] == str(base)
    assert serve_peers.server_env("kvflow-default", args)["PYTHONPATH"].split(os.pathsep)[0] == str(serve_peers.REPO_ROOT)
    assert (serve_peers.server_command("kvflow-default@base", args, Path("/m"), None, 1, 1)
            == serve_peers.server_command("kvflow-default", args, Path("/m"), None, 1, 1))
    with pytest.raises(SystemExit):
        serve_peers.parse_args(["--baseline", str(tmp_path)])


def test_a_baseline_server_imports_the_baseline_kvflow(tmp_path: Path) -> None:
    """``python -m`` puts the working directory before ``PYTHONPATH``: an ``@base`` process
    started from this checkout imported this checkout's ``kvflow``. It starts in the
    baseline checkout (``server_cwd``) and imports that one."""
    base = tmp_path / "base"
    (base / "kvflow").mkdir(parents=True)
    (base / "kvflow" / "__init__.py").write_text("")
    (base / "kvflow" / "__main__.py").write_text("import kvflow; print(kvflow.__file__)\n")
    args = serve_peers.parse_args(["--engines", "kvflow-default", "--baseline", str(base)])
    engine = "kvflow-default@base"
    # started as serve_peers starts it, while the caller sits in this checkout
    out = subprocess.run([sys.executable, "-m", "kvflow"], env=serve_peers.server_env(engine, args),
                         cwd=serve_peers.server_cwd(engine, args) or serve_peers.REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert Path(out.strip()).parent == base / "kvflow"
    assert serve_peers.server_cwd("kvflow-default", args) is None  # this checkout's: where the caller is


def test_offline_table_sets_the_served_decode_rate_against_the_offline_one() -> None:
    """``--offline``: served decode tokens/s is 1000 / mean TPOT (the first token left out, as
    offline), divided by the offline rate."""
    served = {"mean_tpot_ms": 10.0, "mean_ttft_ms": 50.0, "output_throughput": 90.0}
    records = [{"engine": "kvflow-default", "offline_single": {"decode_tok_per_s": 105.0, "ttft_ms": 30.0,
                                                               "other_load_cores": 0.1},
                "scenarios": {"single": served}},
               {"engine": "vllm", "scenarios": {"single": served}}]  # fmt: skip
    table = serve_peers.offline_table(records)
    row = next(line for line in table.splitlines() if line.startswith("kvflow-default"))
    assert row.split()[1:5] == ["105.0", "100.0", "0.952", "30.0"]
    assert "vllm" not in table
    assert serve_peers.offline_table([{"engine": "vllm", "scenarios": {"single": served}}]) is None


def test_offline_single_gets_the_server_engine_arguments() -> None:
    """The offline reference parses the server's own command line with kvflow's parser."""
    from benchmarks.peers.offline_single import engine_kwargs

    kwargs = engine_kwargs(["--model", "/m.gguf", "--num-threads", "2", "--num-kv-blocks", "64", "--host", "127.0.0.1",
                            "--port", "1", "--served-model-name", "model"])  # fmt: skip
    assert kwargs["model"] == "/m.gguf" and kwargs["num_kv_blocks"] == 64 and kwargs["num_threads"] == 2
    assert "host" not in kwargs and "port" not in kwargs


def test_each_checkout_builds_its_own_kernels_before_it_is_measured(tmp_path: Path, monkeypatch) -> None:
    """A baseline checkout's kernel builds are its own (the build name hashes include paths):
    ``python -m kvflow.ops`` runs from each engine's checkout, with its ``PYTHONPATH``."""
    base = tmp_path / "base"
    (base / "kvflow").mkdir(parents=True)
    (base / "kvflow" / "__init__.py").write_text("")
    args = serve_peers.parse_args(["--engines", "kvflow-default", "--baseline", str(base)])
    runs = []
    monkeypatch.setattr(serve_peers.subprocess, "run", lambda cmd, **kw: runs.append((cmd, kw)))
    serve_peers.build_kernels("kvflow-default@base", args)
    serve_peers.build_kernels("kvflow-default", args)
    (cmd, kw), (_, kw2) = runs
    assert cmd[1:] == ["-m", "kvflow.ops"]
    assert kw["cwd"] == base and kw["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(base)
    assert kw2["cwd"] == serve_peers.REPO_ROOT


def test_sampling_settings_reach_the_load_generator(tmp_path: Path) -> None:
    """Greedy by default (--temperature 0, no --top-p); a chat client's sampling when asked;
    out-of-range values refused."""
    cmd = serve_peers.bench_command(serve_peers.parse_args([]), "u", Path("/m"), "concurrent16", tmp_path, "r")
    assert cmd[cmd.index("--temperature") + 1] == "0.0" and "--top-p" not in cmd
    args = serve_peers.parse_args(["--temperature", "0.7", "--top-p", "0.9"])
    cmd = serve_peers.bench_command(args, "u", Path("/m"), "concurrent16", tmp_path, "r")
    assert cmd[cmd.index("--temperature") + 1] == "0.7" and cmd[cmd.index("--top-p") + 1] == "0.9"
    for bad in (["--top-p", "0"], ["--top-p", "1.5"], ["--temperature", "-1"]):
        with pytest.raises(SystemExit):
            serve_peers.parse_args(bad)


def test_thread_changes_reads_kvflows_counter_and_none_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    pages = {"kv": 'kvflow:cpu_threads{model_name="m"} 1.0\nkvflow:cpu_thread_changes_total{model_name="m"} 3.0\n',
             "other": "vllm:num_requests_running 0\n"}
    monkeypatch.setattr(httpx, "get", lambda url, timeout: httpx.Response(200, text=pages[url.split("/")[2]]))
    assert serve_peers._thread_changes("http://kv") == 3.0
    assert serve_peers._thread_changes("http://other") is None
