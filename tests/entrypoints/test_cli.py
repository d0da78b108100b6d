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
