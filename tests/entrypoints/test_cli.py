"""The kvflow command line, run in-process and as the installed console script."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import requires_smollm2
from kvflow.entrypoints.cli import build_parser, main


def test_every_subcommand_parses():
    parser = build_parser()
    for argv in (["generate", "hi"], ["chat"], ["serve", "--port", "9"], ["memory"], ["quantize", "--method", "int8", "--out", "x"]):
        assert parser.parse_args(argv).func is not None


def test_lm_head_quantization_option():
    from kvflow.entrypoints.cli import _engine_kwargs

    parser = build_parser()
    assert _engine_kwargs(parser.parse_args(["generate", "hi"]))["quantize_lm_head"] is False
    assert _engine_kwargs(parser.parse_args(["generate", "--quantize-lm-head", "hi"]))["quantize_lm_head"] is True
    args = parser.parse_args(["generate", "--lm-head-quantization", "int8", "hi"])
    assert _engine_kwargs(args)["quantize_lm_head"] == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--lm-head-quantization", "int2", "hi"])


def test_invalid_option_exits_with_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--max-num-seqs", "0", "--model", "smollm2-135m"])
    assert exc.value.code == 2
    assert "max_num_seqs" in capsys.readouterr().err


@requires_smollm2
@pytest.mark.integration
def test_generate_prints_the_completion(smollm2_dir, capsys):
    assert main(["generate", "The capital of France is", "--model", str(smollm2_dir), "--max-tokens", "4",
                 "--dtype", "float32", "--num-kv-blocks", "16"]) == 0
    assert "Paris" in capsys.readouterr().out


@requires_smollm2
@pytest.mark.integration
def test_console_script_and_module_entry_point(smollm2_dir):
    exe = shutil.which("kvflow")
    commands = [[sys.executable, "-m", "kvflow.entrypoints.cli"]] + ([[exe]] if exe else [])
    for command in commands:
        done = subprocess.run(command + ["--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "generate" in done.stdout


def test_serve_exits_non_zero_when_the_engine_dies(tmp_path):
    """A fault that leaves the engine unusable (here every forward raises): the in-flight
    request gets an OpenAI-shaped 503, and the process exits 1 so that a supervisor restarts
    it. (The server used to stay up answering 503 for ever.)"""
    import os
    import socket
    import time

    import httpx

    from conftest import tiny_hf_model_dir

    folder = tiny_hf_model_dir(tmp_path / "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = (
        "import sys\n"
        "from kvflow.model.llama import LlamaForCausalLM\n"
        "def forward(*args, **kwargs):\n"
        "    raise RuntimeError('injected: the device is gone')\n"
        "LlamaForCausalLM.forward = forward\n"
        "from kvflow.entrypoints.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    repo = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "serve", "--model", str(folder), "--port", str(port), "--dtype", "float32",
         "--num-kv-blocks", "32", "--num-threads", "1", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=10)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError", r.text
        assert proc.wait(timeout=60) == 1
        err = proc.stderr.read().decode()
        assert "kvflow: error: the engine stopped" in err and "unusable" in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
