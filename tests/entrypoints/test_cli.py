"""The kvflow command line, run in-process and as the installed console script."""

from __future__ import annotations

import json
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


# ------------------------------------------------------------------ flags from EngineArgs
def _help(argv):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv + ["--help"])
    assert exc.value.code == 0
    return " ".join(buf.getvalue().split())


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"]])
def test_every_engine_args_field_is_one_flag_with_its_default(command):
    """One flag per EngineArgs field (seed, quantization_group_size and model_cache_dir had
    none), each with the field's default, none listed by hand."""
    from dataclasses import asdict, fields

    from kvflow.engine.arg_utils import EngineArgs
    from kvflow.entrypoints.cli import _engine_kwargs

    parser = build_parser()
    args = parser.parse_args(command)
    assert _engine_kwargs(args) == asdict(EngineArgs())
    sub = parser._subparsers._group_actions[0].choices[command[0]]
    dests = [a.dest for a in sub._actions]
    for f in fields(EngineArgs):
        assert dests.count(f.name) == (2 if f.name == "quantize_lm_head" else 1), f.name
        assert "--" + f.name.replace("_", "-") in sub._option_string_actions
    assert "seed" in dests and "quantization_group_size" in dests and "model_cache_dir" in dests


def test_help_shows_the_defaults():
    text = _help(["generate"])
    for wanted in ("tokens per KV cache block (default: 16)", "max new tokens per reply (default: 64)",
                   "0 = greedy (default: 0.0)", "maximum number of concurrently running requests (default: 64)",
                   "(default: 512MiB)", "per-step token budget (prefill chunks plus decodes) (default: 2048)"):
        assert wanted in text, wanted
    assert "max new tokens per reply (default: 256)" in _help(["chat"])
    assert "TCP port, 1-65535; checked free before the model loads (default: 8000)" in _help(["serve"])


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == "kvflow 0.1.0"


def test_byte_sizes_and_json_flags():
    from kvflow.entrypoints.cli import _engine_kwargs

    args = build_parser().parse_args(["generate", "hi", "--kv-cache-memory-bytes", "1GiB", "--swap-space-bytes", "512MiB",
                                      "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                                      "--seed", "7", "--quantization-group-size", "64", "--no-enable-prefix-caching"])
    kw = _engine_kwargs(args)
    assert (kw["kv_cache_memory_bytes"], kw["swap_space_bytes"]) == (2**30, 512 * 2**20)
    assert kw["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    assert (kw["seed"], kw["quantization_group_size"], kw["enable_prefix_caching"]) == (7, 64, False)
    assert build_parser().parse_args(["memory", "--budget", "8GiB"]).budget == 8 * 2**30


# ------------------------------------------------------------------ errors: one line
def _one_line_error(capsys, argv, code):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("kvflow: error: ")]
    assert exc.value.code == code, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, wanted", [
    (["--speculative-config", "{bad"], "argument --speculative-config: not valid JSON"),
    (["--speculative-config", "[4]"], "speculative_config must be a JSON object"),
    (["--speculative-config", '{"method": "magic", "num_speculative_tokens": 2}'], "speculative_config.method"),
    (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["--kv-cache-memory-bytes", "lots"], "cannot parse a byte size from 'lots'"),
    (["--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--collective-timeout-s", "0"], "collective_timeout_s"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, wanted):
    line = _one_line_error(capsys, ["generate", "hi", "--attention-backend", "torch", *argv], 2)
    assert wanted in line


@pytest.mark.parametrize("argv, wanted", [
    (["--method", "int8", "--group-size", "64"], "--group-size is for the INT4 methods, not int8"),
    (["--method", "int4", "--calibration-tokens", "9"], "are for --method int4-awq, not int4"),
    (["--method", "int4-awq", "--calibration-tokens", "-4"], "--calibration-tokens: must be at least 1, got -4"),
    (["--method", "int4-awq", "--calibration-tokens", "0"], "--calibration-tokens: must be at least 1, got 0"),
    (["--method", "int4-awq", "--calibration", "/nonexistent.txt"], "--calibration: no such file"),
])
def test_quantize_refuses_options_that_do_not_apply_before_loading(capsys, argv, wanted, tmp_path):
    """A negative --calibration-tokens sliced the text from its end (7,650 tokens, 65 s);
    int8 took --group-size and --calibration and ignored them, a missing file included."""
    line = _one_line_error(capsys, ["quantize", *argv, "--out", str(tmp_path / "out")], 2)
    assert wanted in line and not (tmp_path / "out").exists()


@requires_smollm2
def test_quantize_refuses_a_quantized_model_and_a_used_folder(capsys, smollm2_dir, tmp_path):
    """Quantizing a kvflow-quantized folder wrote a folder labelled int4 holding int8
    weights that failed to load with a 9 KB state-dict error; --out into a folder of other
    files mixed them."""
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    line = _one_line_error(capsys, ["quantize", "--model", str(smollm2_dir), "--method", "int8", "--out", str(used)], 2)
    assert "exists and is not an empty folder" in line and sorted(p.name for p in used.iterdir()) == ["notes.txt"]
    done = tmp_path / "int8"
    assert main(["quantize", "--model", str(smollm2_dir), "--method", "int8", "--out", str(done), "-q"]) == 0
    line = _one_line_error(capsys, ["quantize", "--model", str(done), "--method", "int4", "--out", str(tmp_path / "x")], 2)
    assert "is already quantized (int8)" in line and not (tmp_path / "x").exists()


def test_a_broken_model_folder_is_a_user_error_naming_the_file(capsys, tmp_path):
    """Invalid JSON in config.json and a garbage model.safetensors were runtime failures
    (exit 1, "OSError: It looks like the config file ...", "SafetensorError: ..."): they are
    the user's files, so exit 2 with the file named."""
    bad_config = tmp_path / "bad-config"
    bad_config.mkdir()
    (bad_config / "config.json").write_text("{bad")
    line = _one_line_error(capsys, ["generate", "hi", "--model", str(bad_config)], 2)
    assert f"{bad_config / 'config.json'} is not valid JSON" in line
    bad_weights = tmp_path / "bad-weights"
    bad_weights.mkdir()
    (bad_weights / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64}))
    (bad_weights / "model.safetensors").write_bytes(b"\xff" * 4000)
    line = _one_line_error(capsys, ["generate", "hi", "--model", str(bad_weights), "--attention-backend", "torch"], 2)
    assert "model.safetensors is not a readable safetensors file" in line


def test_a_subcommands_unknown_argument_points_to_its_own_help(capsys):
    for argv, command in ((["generate", "hi", "--foo"], "generate"), (["chat", "hi"], "chat")):
        line = _one_line_error(capsys, argv, 2)
        assert line.endswith(f"(see 'kvflow {command} --help')"), line


def test_llama_servers_flags_name_kvflows(capsys):
    """``kvflow serve -c 2048 -t 1`` (llama-server's habits) said only "unrecognized arguments";
    the error names kvflow's flag for each."""
    line = _one_line_error(capsys, ["serve", "-m", "x.gguf", "--ctx-size=2048", "-t", "1", "-np", "4", "--port", "9"], 2)
    assert ("llama-server's -m is the model as the first argument or --model, --ctx-size is --max-model-len, "
            "-t is --num-threads, -np is --max-num-seqs here") in line, line
    assert line.endswith("(see 'kvflow serve --help')"), line
    assert "llama-server" not in _one_line_error(capsys, ["generate", "hi", "--foo"], 2)


def test_serve_refuses_an_unknown_log_level_at_parse_time(capsys):
    """With -q the level was only read by uvicorn after the model loaded (KeyError, exit 1)."""
    line = _one_line_error(capsys, ["serve", "-q", "--log-level", "bogus", "--port", "9"], 2)
    assert "--log-level: invalid choice: 'bogus'" in line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is present")
def test_device_cuda_without_cuda_is_one_line(capsys):
    line = _one_line_error(capsys, ["generate", "hi", "--device", "cuda"], 2)
    assert "device='cuda', but" in line


def test_a_runtime_failure_is_one_line_and_exit_1(capsys, monkeypatch):
    import kvflow

    def broken(**kwargs):
        raise RuntimeError("the engine broke\nover two lines")

    monkeypatch.setattr(kvflow, "LLM", broken)
    line = _one_line_error(capsys, ["generate", "hi"], 1)
    assert line == ("kvflow: error: RuntimeError: the engine broke over two lines "
                    "(KVFLOW_TRACEBACK=1 shows the traceback)")
    monkeypatch.setenv("KVFLOW_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="the engine broke"):
        main(["generate", "hi"])


# ------------------------------------------------------------------ progress messages
@pytest.mark.parametrize("quiet", [False, True])
def test_progress_messages_on_stderr_unless_quiet(capsys, monkeypatch, quiet):
    """What the library logs on the kvflow logger during a cold start reaches stderr as
    'kvflow: ...' (warnings as 'kvflow: warning: ...'); --quiet keeps only the warnings."""
    import logging

    import kvflow

    class Stub:
        def __init__(self, **kwargs):
            logging.getLogger("kvflow.model.loader").info("converting a.gguf to /cache/a (once, ~20 s)")
            logging.getLogger("kvflow.ops.build").info("building the C++ CPU RMSNorm kernel (once, ~20 s)")
            logging.getLogger("kvflow.layers.linear").warning("float16 linears use PyTorch's generic matmul")

        def generate(self, prompts, params, use_tqdm=True):
            assert use_tqdm is not quiet

            class Out:
                outputs = [type("C", (), {"text": "ok"})]

            return [Out]

    monkeypatch.setattr(kvflow, "LLM", Stub)
    assert main(["generate", "hi"] + (["--quiet"] if quiet else [])) == 0
    captured = capsys.readouterr()
    assert captured.out == "ok\n"
    progress = ["kvflow: converting a.gguf to /cache/a (once, ~20 s)",
                "kvflow: building the C++ CPU RMSNorm kernel (once, ~20 s)"]
    assert captured.err.splitlines() == ([] if quiet else progress) + [
        "kvflow: warning: float16 linears use PyTorch's generic matmul"]


def test_quiet_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVFLOW_QUIET", "1")
    assert build_parser().parse_args(["generate", "hi"]).quiet is True
    monkeypatch.delenv("KVFLOW_QUIET")
    assert build_parser().parse_args(["generate", "hi"]).quiet is False


# ------------------------------------------------------------------ chat
@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory):
    """A tiny random Llama with a real (small, byte-level BPE) tokenizer and a chat template."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from conftest import tiny_model, tiny_model_config
    from model.test_llama import to_hf_state_dict

    path = tmp_path_factory.mktemp("tiny_chat")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello there, how are you today?", "tell me a story about a cat"] * 4,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(path)
    cfg = tiny_model_config(vocab_size=len(fast))
    hf = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False,
    )
    hf.save_pretrained(path)
    state = {k: v.contiguous() for k, v in to_hf_state_dict(tiny_model(cfg)).items()}
    save_file(state, str(path / "model.safetensors"))
    del torch
    return path


class _Inputs:
    """input() replacement: returns the scripted lines; an exception class is raised."""

    def __init__(self, script):
        self.script = list(script)

    def __call__(self, prompt=""):
        item = self.script.pop(0)
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item()
        return item


def _run_chat(monkeypatch, tiny_chat_dir, script, interrupt_after_writes=None, max_tokens=40, extra=()):
    """Run `kvflow chat` on the tiny model with scripted input; a real SIGINT is sent to this
    process after the reply's n-th write when interrupt_after_writes is set. Returns the
    LLM, the conversations it was asked to render and what was written per reply."""
    import builtins
    import io
    import os
    import signal

    import kvflow

    created, rendered = [], []

    class RecordingLLM(kvflow.LLM):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            created.append(self)

        def apply_chat_template(self, conversation):
            rendered.append([dict(m) for m in conversation])
            return super().apply_chat_template(conversation)

    class Out(io.StringIO):
        writes = 0

        def write(self, text):
            Out.writes += 1
            if interrupt_after_writes is not None and Out.writes == interrupt_after_writes:
                os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C in a terminal does
            return super().write(text)

    out = Out()
    monkeypatch.setattr(kvflow, "LLM", RecordingLLM)
    monkeypatch.setattr(builtins, "input", _Inputs(script))
    monkeypatch.setattr("sys.stdout", out)
    code = main(["chat", "--model", str(tiny_chat_dir), "--dtype", "float32", "--num-kv-blocks", "32",
                 "--max-tokens", str(max_tokens), "--ignore-eos", "--attention-backend", "torch", "--quiet", *extra])
    return code, created[0], rendered, out.getvalue()


def test_chat_ctrl_c_stops_the_reply_and_keeps_the_conversation(monkeypatch, tiny_chat_dir, capsys):
    """Ctrl-C during a reply: the reply stops (its request aborted, blocks freed), the
    conversation goes on with the part shown; an empty line is ignored; Ctrl-C twice at
    the prompt quits with status 0."""
    import signal

    handler = signal.getsignal(signal.SIGINT)
    code, llm, rendered, out = _run_chat(
        monkeypatch, tiny_chat_dir, ["hello", "", "   ", "tell me more", KeyboardInterrupt, KeyboardInterrupt],
        interrupt_after_writes=3)
    assert code == 0
    assert signal.getsignal(signal.SIGINT) is handler  # restored after each reply
    assert [len(c) for c in rendered] == [1, 3]  # the empty lines sent nothing
    first_reply = rendered[1][1]
    assert rendered[1][0] == {"role": "user", "content": "hello"} and first_reply["role"] == "assistant"
    assert rendered[1][2] == {"role": "user", "content": "tell me more"}
    stopped_ids = llm.tokenizer.encode(first_reply["content"], add_special_tokens=False)
    assert 0 < len(stopped_ids) < 40  # stopped early, the shown part kept
    stats = llm.get_stats()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    err = capsys.readouterr().err
    assert err.count("[reply stopped]") == 1 and "(Ctrl-C again or Ctrl-D to quit)" in err


def test_chat_ctrl_d_quits_and_single_ctrl_c_at_the_prompt_does_not(monkeypatch, tiny_chat_dir):
    code, llm, rendered, out = _run_chat(monkeypatch, tiny_chat_dir, [KeyboardInterrupt, "hi", EOFError], max_tokens=3)
    assert code == 0 and len(rendered) == 1 and out.count("\n") == 1
    assert llm.get_stats()["num_running"] == 0


def test_chat_outgrowing_the_context_drops_the_oldest_exchange_and_goes_on(monkeypatch, tiny_chat_dir, capsys):
    """A conversation longer than max_model_len quit the session with exit 2 (the rest of
    the input unread): it now lets go of its oldest exchanges, the system message kept; a
    turn too long by itself is refused with the engine's message and the session goes on."""
    long_turn = " ".join(["word"] * 200)
    code, llm, rendered, out = _run_chat(
        monkeypatch, tiny_chat_dir, ["one two three", "four five six", "seven eight nine", long_turn, "ten", EOFError],
        max_tokens=8, extra=("--max-model-len", "112", "--system", "Be brief."))
    assert code == 0
    err = capsys.readouterr().err
    assert "(the oldest exchange was dropped to fit the context)" in err and "max_model_len=112" in err, err
    assert all(c[0] == {"role": "system", "content": "Be brief."} for c in rendered)
    last = rendered[-1]
    assert last[-1] == {"role": "user", "content": "ten"} and all(m["content"] != long_turn for m in last)
    assert out.count("\n") == 4  # four replies: the long turn got none
    assert llm.get_stats()["num_running"] == 0


def test_chat_a_turn_too_long_by_itself_keeps_the_earlier_exchanges(monkeypatch, tiny_chat_dir, capsys):
    """A turn too long by itself first dropped every earlier exchange from the conversation
    (with "(the oldest exchange was dropped ...)") and was then refused: the session went on
    having forgotten them. The refused turn now leaves the conversation as it was."""
    long_turn = " ".join(["word"] * 200)
    code, llm, rendered, out = _run_chat(
        monkeypatch, tiny_chat_dir, ["one two three", long_turn, "ten", EOFError],
        max_tokens=8, extra=("--max-model-len", "112", "--system", "Be brief."))
    assert code == 0
    err = capsys.readouterr().err
    assert "max_model_len=112" in err and "was dropped" not in err, err
    last = rendered[-1]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user"], last
    assert last[1]["content"] == "one two three" and last[-1]["content"] == "ten", last
    assert out.count("\n") == 2  # two replies: the long turn got none


def test_chat_a_line_that_is_not_utf8_is_refused_and_the_session_goes_on(monkeypatch, tiny_chat_dir, capsys):
    """A \\xff byte on stdin (input() hands it over as the lone surrogate '\\udcff') ended the
    whole session with exit 2 ("messages hold a lone surrogate"), the rest of the input unread:
    that turn is refused with the message and the conversation goes on without it."""
    code, llm, rendered, out = _run_chat(monkeypatch, tiny_chat_dir, ["hi", "bad \udcff byte", "hello again", EOFError],
                                         max_tokens=3)
    assert code == 0
    err = capsys.readouterr().err
    assert "kvflow: error: " in err and "lone surrogate" in err, err
    last = rendered[-1]  # (the bad line's history was rendered, and refused, before it)
    assert [m["role"] for m in last] == ["user", "assistant", "user"], last
    assert last[0]["content"] == "hi" and last[-1]["content"] == "hello again"
    assert llm.get_stats()["num_running"] == 0


def test_chat_survives_bytes_that_are_not_utf8_on_a_strict_stdin(monkeypatch, tiny_chat_dir, capsys):
    """Under a UTF-8 locale (en_US.UTF-8) Python reads stdin strictly: input() raised
    UnicodeDecodeError on a \\xff byte and ended the session (exit 2); the chat reads stdin
    with surrogateescape, so the line is refused as under the C locale and the session goes on."""
    import io

    import kvflow

    created = []

    class RecordingLLM(kvflow.LLM):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            created.append(self)

    stdin = io.TextIOWrapper(io.BytesIO(b"hi\n\xff\xfe bad\nhello again\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr(kvflow, "LLM", RecordingLLM)
    monkeypatch.setattr("sys.stdin", stdin)
    code = main(["chat", "--model", str(tiny_chat_dir), "--dtype", "float32", "--num-kv-blocks", "32",
                 "--max-tokens", "2", "--ignore-eos", "--attention-backend", "torch", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "lone surrogate" in captured.err and "codec can't decode" not in captured.err, captured.err
    assert created[0].get_stats()["num_running"] == 0


@pytest.mark.parametrize("names", [[""], ["  "], ["a", " b"]])
def test_serve_refuses_blank_served_model_names(names, capsys, monkeypatch):
    """--served-model-name "" served a model with id "" (every response's model)."""
    from kvflow.engine.llm_engine import LLMEngine

    def no_model(cls, engine_args):
        raise AssertionError("the model was loaded: the names were not refused first")

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(no_model))
    with pytest.raises(SystemExit) as exc:
        main(["serve", "smollm2-135m", "--served-model-name", *names])
    assert exc.value.code == 2
    assert "--served-model-name" in capsys.readouterr().err


def test_stream_reply_closes_the_request_on_keyboard_interrupt(monkeypatch, tiny_chat_dir):
    """Off the main thread (no signal handler) a KeyboardInterrupt from the stream still
    stops only the reply and aborts its request."""
    import threading

    from kvflow import LLM, SamplingParams
    from kvflow.entrypoints.cli import stream_reply

    llm = LLM(model=str(tiny_chat_dir), dtype="float32", num_kv_blocks=32, attention_backend="torch")
    step, calls = llm.engine.step, []

    def interrupted_step():  # Ctrl-C arriving during the third step
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    result = {}

    def run():
        import io

        result["value"] = stream_reply(llm, {"prompt_token_ids": [5, 6, 7]},
                                       SamplingParams(max_tokens=30, ignore_eos=True), out=io.StringIO())

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    text, stopped = result["value"]
    assert stopped and len(calls) == 3  # the reply ended at the interrupted step
    stats = llm.get_stats()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


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


def test_serve_agent_flags(tmp_path):
    from kvflow.entrypoints.cli import load_chat_template

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(template)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    assert load_chat_template(None) is None
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    args = build_parser().parse_args(["serve", "--tool-call-parser", "mistral", "--reasoning-parser", "deepseek_r1"])
    assert (args.tool_call_parser, args.reasoning_parser, args.chat_template) == ("mistral", "deepseek_r1", None)
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, "nope"])


def test_serve_takes_the_model_positionally_like_vllm_serve(tmp_path):
    """`kvflow serve MODEL` (vLLM's form) with --pooling mean and --scheduling-policy
    priority: the folder is served, /v1/embeddings pools by the mean, priority is accepted,
    /tokenize and /version answer."""
    import importlib.metadata
    import os
    import socket
    import time

    import httpx

    from conftest import tiny_hf_model_dir, tiny_tokenizer
    from kvflow import LLM

    folder = tiny_hf_model_dir(tmp_path / "tiny-serve")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", str(folder), "--port", str(port), "--dtype",
         "float32", "--num-kv-blocks", "32", "--num-threads", "1", "--log-level", "warning", "--pooling", "mean",
         "--scheduling-policy", "priority", "--attention-backend", "torch"],
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
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny-serve"
        assert httpx.get(url + "/version").json() == {"version": importlib.metadata.version("kvflow")}
        assert httpx.post(url + "/tokenize", json={"prompt": "abc"}).json()["tokens"] == tiny_tokenizer().encode("abc")
        got = httpx.post(url + "/v1/embeddings", json={"input": "Hello there"}, timeout=60).json()["data"][0]
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "priority": -3}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    with LLM(model=str(folder), dtype="float32", num_kv_blocks=32, attention_backend="torch") as llm:
        want = llm.embed("Hello there", pooling="mean", use_tqdm=False)[0].outputs.embedding
    assert max(abs(a - b) for a, b in zip(got["embedding"], want)) < 1e-5


def test_serve_refuses_the_model_given_twice(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "smollm2-135m", "--model", "qwen2.5-coder-0.5b"])
    assert info.value.code == 2
    assert "the model is given twice" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["99999", "65536", "-5", "0", "http"])
def test_serve_bad_port_is_a_usage_error_before_anything_loads(capsys, monkeypatch, port):
    from kvflow.engine.llm_engine import LLMEngine

    def never(*args, **kwargs):
        raise AssertionError("the model loaded before --port was checked")

    monkeypatch.setattr(LLMEngine, "from_engine_args", never)
    line = _one_line_error(capsys, ["serve", "--port", port], 2)
    assert line.startswith("kvflow: error: argument --port: ") and ("1-65535" in line or "not an integer" in line), line


def _taken_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_serve_on_a_port_in_use_fails_before_the_model_loads(capsys, monkeypatch):
    from kvflow.engine.llm_engine import LLMEngine

    def never(*args, **kwargs):
        raise AssertionError("the model loaded before the port was checked")

    monkeypatch.setattr(LLMEngine, "from_engine_args", never)
    sock, port = _taken_port()
    with sock:
        line = _one_line_error(capsys, ["serve", "--port", str(port)], 1)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line, line


def test_serve_port_taken_while_the_model_loads_is_one_line_and_exit_1(capsys, monkeypatch):
    # uvicorn's own bind failure (its exit status 3) becomes the CLI's one line and exit 1
    from conftest import TINY_TEXT_VOCAB, tiny_engine, tiny_model_config, tiny_tokenizer
    from kvflow.engine.llm_engine import LLMEngine

    taken = []

    def load_while_someone_takes_the_port(*args, **kwargs):
        sock, _ = taken[0]
        sock.listen()
        return tiny_engine(tokenizer=tiny_tokenizer(), config=tiny_model_config(vocab_size=TINY_TEXT_VOCAB))

    import socket

    free = socket.socket()
    free.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    free.bind(("127.0.0.1", 0))  # bound, not listening: the pre-check (SO_REUSEADDR) can still bind it
    taken.append((free, free.getsockname()[1]))
    monkeypatch.setattr(LLMEngine, "from_engine_args", load_while_someone_takes_the_port)
    with free:
        line = _one_line_error(capsys, ["serve", "--port", str(taken[0][1])], 1)
    assert f"cannot listen on 127.0.0.1:{taken[0][1]}" in line, line


@pytest.mark.parametrize("argv, wanted", [
    (["--max-queue-len", "0"], "argument --max-queue-len: must be at least 1, got 0"),
    (["--max-queue-len", "-1"], "argument --max-queue-len: must be at least 1, got -1"),
    (["--timeout-keep-alive", "nan"], "argument --timeout-keep-alive: must be a number of seconds > 0, got nan"),
    (["--timeout-keep-alive", "0"], "argument --timeout-keep-alive: must be a number of seconds > 0"),
    (["--request-read-timeout", "-3"], "argument --request-read-timeout: must be a number of seconds > 0"),
    (["--max-request-bytes", "0"], "argument --max-request-bytes: must be at least 1 byte, got 0"),
    (["--router", "sglang-router"], "--router needs --data-parallel-size N with N > 1"),
    (["--router-policy=round_robin", "--data-parallel-size", "1"], "--router-policy needs --data-parallel-size N"),
    (["--chat-template", "./missing.jinja"], "--chat-template: no such file"),
    (["--enable-lora", "--lora-modules", "smollm2-135m=./a"], "--lora-modules: 'smollm2-135m' is a name of the base"),
    (["--enable-lora", "--lora-modules", "b=./a", "--served-model-name", "a", "b"], "--lora-modules: 'b' is a name of"),
    (["--chat-template", "./missing.jinja", "--data-parallel-size", "2"], "--chat-template: no such file"),
])
def test_serve_bad_server_flags_are_usage_errors_before_anything_loads(capsys, monkeypatch, argv, wanted):
    """They were exit 2 only after the model had loaded (seconds to minutes; with
    --data-parallel-size, in every replica)."""
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.entrypoints import data_parallel

    def never(*args, **kwargs):
        raise AssertionError("the model loaded (or a replica started) before the flag was checked")

    monkeypatch.setattr(LLMEngine, "from_engine_args", never)
    monkeypatch.setattr(data_parallel, "serve_data_parallel", never)
    line = _one_line_error(capsys, ["serve", "--port", "18290", *argv], 2)
    assert wanted in line, line


@pytest.mark.parametrize("key", ["", "   "])
def test_serve_refuses_an_empty_api_key_before_anything_loads(capsys, monkeypatch, key):
    # --api-key "$KEY" with KEY unset: an empty key matched "Bearer " and an absent x-api-key.
    from kvflow.engine.llm_engine import LLMEngine

    def never(*args, **kwargs):
        raise AssertionError("the model loaded before --api-key was checked")

    monkeypatch.setattr(LLMEngine, "from_engine_args", never)
    line = _one_line_error(capsys, ["serve", "--api-key", key], 2)
    assert line.startswith("kvflow: error: argument --api-key: ") and "empty" in line, line


# ------------------------------------------------------------------ vLLM's flags (s30)
def test_no_flag_is_taken_by_an_abbreviation():
    """argparse's prefix matching read vLLM's `--swap-space 4` as `--swap-space-bytes 4`
    (4 bytes, no swap block, no message); abbreviations are off on every parser."""
    from kvflow.entrypoints.cli import _engine_kwargs

    parser = build_parser()
    args = parser.parse_args(["serve", "--swap-space", "4", "--preemption-mode", "swap"])
    assert (args.swap_space, args.swap_space_bytes) == (4.0, None)
    assert _engine_kwargs(args)["swap_space_bytes"] == 4 * 2**30  # GiB, as LLM(swap_space=4)
    assert "swap_space" not in _engine_kwargs(args)
    for argv in (["generate", "hi", "--swap-space-b", "4"], ["serve", "--max-num-se", "2"], ["chat", "--sys", "x"],
                 ["memory", "--budg", "1GiB"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    with pytest.raises(ValueError, match="swap_space .* and swap_space_bytes are the same option"):
        _engine_kwargs(parser.parse_args(["generate", "hi", "--swap-space", "1", "--swap-space-bytes", "1MiB"]))


VLLM_SERVE_FLAGS = ["--gpu-memory-utilization", "0.5", "--trust-remote-code", "--disable-log-requests",
                    "--enable-chunked-prefill", "--enable-auto-tool-choice", "--max-logprobs", "5",
                    "--generation-config", "auto", "--uvicorn-log-level", "warning"]


def test_vllm_option_flags_come_from_vllm_compat():
    """Each vLLM keyword LLM() takes (vllm_compat's one list) is a flag of generate, chat and
    serve, unless the command has a kvflow flag of that name; serve also takes vLLM's server
    flags that change nothing here."""
    from kvflow.entrypoints import vllm_compat

    parser = build_parser()
    subs = parser._subparsers._group_actions[0].choices
    assert set(vllm_compat.CLI_VALUE) == vllm_compat.vllm_option_names() | set(vllm_compat.SERVE_IGNORED)
    for command in ("generate", "chat", "serve"):
        flags = subs[command]._option_string_actions
        for name in vllm_compat.vllm_option_names():
            assert "--" + name.replace("_", "-") in flags, (command, name)
    assert "--disable-log-requests" in subs["serve"]._option_string_actions
    assert "--disable-log-requests" not in subs["generate"]._option_string_actions
    args = parser.parse_args(["serve", "m", *VLLM_SERVE_FLAGS])
    assert (args.gpu_memory_utilization, args.trust_remote_code, args.max_logprobs) == (0.5, True, 5)
    assert (args.uvicorn_log_level, args.enable_chunked_prefill, args.generation_config) == ("warning", True, "auto")


def test_vllm_flags_translate_as_llm_keywords(monkeypatch, caplog):
    """--gpu-memory-utilization sizes the KV cache as LLM(gpu_memory_utilization=...) does,
    the no-op ones log the same note, and one kvflow cannot honour is refused by name."""
    import logging

    from kvflow.entrypoints import vllm_compat
    from kvflow.entrypoints.cli import _engine_kwargs

    parser = build_parser()
    monkeypatch.setattr(vllm_compat, "kv_budget_from_utilization", lambda fraction, model, device, cache: 12345)
    with caplog.at_level(logging.INFO, logger="kvflow.entrypoints.vllm_compat"):
        kw = _engine_kwargs(parser.parse_args(["generate", "hi", "--gpu-memory-utilization", "0.5",
                                               "--trust-remote-code", "--no-enable-chunked-prefill"]))
    assert kw["kv_cache_memory_bytes"] == 12345 and "gpu_memory_utilization" not in kw
    assert set(kw) == set(_engine_kwargs(parser.parse_args(["generate", "hi"])))  # EngineArgs' fields only
    assert "vLLM option trust_remote_code=True: accepted, no effect" in caplog.text
    assert "vLLM option enable_chunked_prefill=False: accepted, no effect" in caplog.text
    for argv, match in ((["--pipeline-parallel-size", "2"], "pipeline_parallel_size=2 is not supported"),
                        (["--generation-config", "vllm"], "generation_config='vllm' is not supported"),
                        (["--tokenizer", "/elsewhere"], "tokenizer='/elsewhere' is not supported"),
                        (["--hf-overrides", '{"a": 1}'], "hf_overrides=.* is not supported")):
        with pytest.raises(ValueError, match=match):
            _engine_kwargs(parser.parse_args(["generate", "hi", *argv]))


def test_serve_takes_vllm_serve_flags_and_several_served_names(capsys, monkeypatch):
    """`vllm serve`'s common flags were "unrecognized arguments"; `--served-model-name a b`
    made b the model. The first name is the one reported, every one is accepted."""
    import types

    from kvflow.engine import async_engine
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.entrypoints import cli
    from kvflow.entrypoints.openai import server

    seen = {}
    monkeypatch.setattr(cli, "check_bindable", lambda host, port: None)
    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(lambda cls, engine_args: seen.update(
        engine_args=engine_args) or types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_model_len=64))))
    monkeypatch.setattr(async_engine, "AsyncLLMEngine", lambda *a, **k: types.SimpleNamespace(error=None))
    monkeypatch.setattr(server, "build_app", lambda engine, name, max_len, **kw: seen.update(
        name=name, aliases=kw["model_aliases"], served=kw["served_model_names"]) or "app")
    monkeypatch.setattr(server, "make_server", lambda app, host, port, log_level, *a: seen.update(
        uvicorn_log_level=log_level) or types.SimpleNamespace(run=lambda: None, should_exit=False))
    monkeypatch.setattr(vllm_compat_module(), "kv_budget_from_utilization", lambda *a: 2**20)
    assert main(["serve", "smollm2-135m", *VLLM_SERVE_FLAGS, "--served-model-name", "a", "b"]) == 0
    assert seen["name"] == "a" and seen["aliases"] == ("smollm2-135m",) and seen["served"] == ("b",)
    assert seen["engine_args"].model == "smollm2-135m" and seen["engine_args"].kv_cache_memory_bytes == 2**20
    assert seen["uvicorn_log_level"] == "warning"
    err = capsys.readouterr().err
    for name in ("trust_remote_code", "disable_log_requests", "enable_chunked_prefill", "enable_auto_tool_choice",
                 "max_logprobs"):
        assert f"kvflow: vLLM option {name}=" in err, name
    assert main(["serve", "smollm2-135m", "-q", "--served-model-name", "only"]) == 0
    assert seen["name"] == "only" and seen["aliases"] == ("smollm2-135m",) and seen["served"] == ()
    assert seen["uvicorn_log_level"] == "info"


def vllm_compat_module():
    from kvflow.entrypoints import vllm_compat

    return vllm_compat


@pytest.mark.parametrize("entries, wanted", [
    (['{"name": "sql", "path": "/a/sql", "base_model_name": "smollm2-135m"}'], {"sql": "/a/sql"}),
    (['[{"name": "sql", "path": "/a/sql"}, {"name": "chat", "path": "/a/chat"}]', "x=/a/x"],
     {"sql": "/a/sql", "chat": "/a/chat", "x": "/a/x"}),
    (["sql=/a/sql"], {"sql": "/a/sql"}),
])
def test_serve_takes_vllms_json_lora_modules(monkeypatch, entries, wanted):
    """vLLM's --lora-modules takes NAME=PATH and JSON ('{"name", "path", "base_model_name"}' or
    a list of them, its docs/features/lora.md form); kvflow refused the JSON form ("takes
    NAME=PATH entries")."""
    from types import SimpleNamespace

    from kvflow.engine import async_engine
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.entrypoints.openai import server

    class Built(BaseException):  # (main turns an Exception into exit 1)
        pass

    def build_app(*args, **kwargs):
        raise Built(kwargs["lora_modules"])

    monkeypatch.setattr(LLMEngine, "from_engine_args",
                        lambda args: SimpleNamespace(scheduler_config=SimpleNamespace(max_model_len=64)))
    monkeypatch.setattr(async_engine, "AsyncLLMEngine", lambda *args, **kwargs: None)
    monkeypatch.setattr(server, "build_app", build_app)
    with pytest.raises(Built) as built:
        main(["serve", "--port", "18291", "--enable-lora", "--lora-modules", *entries])
    assert built.value.args[0] == wanted


@pytest.mark.parametrize("entry, wanted", [
    ('{"name": "sql", "path": "/a", "base_model_name": "meta-llama/Llama-2-7b-hf"}',
     "adapter 'sql' has base_model_name 'meta-llama/Llama-2-7b-hf', which is not the served model"),
    ('{"name": "sql"}', "each JSON entry needs a non-empty name and path"),
    ('{"name": "sql", "path": "/a", "rank": 8}', "unknown field(s) rank"),
    ('{"name": "sql", "path": "/a", "is_3d_lora_weight": true}', "is_3d_lora_weight is not supported by kvflow"),
    ('{"name": "sql", path}', "--lora-modules takes NAME=PATH or JSON entries"),
    ("[3]", "a JSON entry is an object with name and path"),
])
def test_serve_refuses_bad_json_lora_modules_by_name(capsys, monkeypatch, entry, wanted):
    from kvflow.engine.llm_engine import LLMEngine

    def never(*args, **kwargs):
        raise AssertionError("the model loaded before --lora-modules was checked")

    monkeypatch.setattr(LLMEngine, "from_engine_args", never)
    line = _one_line_error(capsys, ["serve", "--port", "18292", "--enable-lora", "--lora-modules", entry], 2)
    assert wanted in line, line


@pytest.mark.parametrize("value, wanted", [("2k", 2000), ("25.6k", 25600), ("2K", 2048), ("4096", 4096)])
def test_max_model_len_takes_vllms_human_readable_counts(value, wanted):
    """vLLM's --max-model-len / --max-num-batched-tokens take 32k (32,000) and 32K (32,768);
    kvflow said "invalid int value: '2k'"."""
    for command in (["serve"], ["generate", "x"]):
        args, _ = build_parser().parse_known_args([*command, "--max-model-len", value, "--max-num-batched-tokens", value])
        assert (args.max_model_len, args.max_num_batched_tokens) == (wanted, wanted)


@pytest.mark.parametrize("value, wanted", [
    ("1.5K", "argument --max-model-len: invalid int value: '1.5K' (a binary suffix"),
    ("auto", "argument --max-model-len: invalid int value: 'auto'"),
])
def test_max_model_len_refuses_what_it_cannot_read(capsys, value, wanted):
    line = _one_line_error(capsys, ["serve", "--max-model-len", value], 2)
    assert wanted in line, line


def _built_app_kwargs(monkeypatch, argv):
    """``main(["serve", *argv])`` up to ``build_app`` (no model loads): its keyword arguments."""
    from types import SimpleNamespace

    from kvflow.engine import async_engine
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.entrypoints.openai import server

    class Built(BaseException):  # (main turns an Exception into exit 1)
        pass

    def build_app(*args, **kwargs):
        raise Built(kwargs)

    monkeypatch.setattr(LLMEngine, "from_engine_args",
                        lambda args: SimpleNamespace(scheduler_config=SimpleNamespace(max_model_len=64)))
    monkeypatch.setattr(async_engine, "AsyncLLMEngine", lambda *args, **kwargs: None)
    monkeypatch.setattr(server, "build_app", build_app)
    with pytest.raises(Built) as built:
        main(["serve", "--port", "18293", *argv])
    return built.value.args[0]


@pytest.mark.parametrize("env, argv, wanted", [
    ("s3cret", [], ("s3cret",)),
    ("s3cret", ["--api-key", "flag"], ("flag",)),  # --api-key wins, as in vLLM
    ("", [], None),  # empty: no key, as vLLM reads it
    (None, [], None),
])
def test_serve_takes_the_api_key_from_vllm_api_key(monkeypatch, env, argv, wanted):
    """vLLM's server requires VLLM_API_KEY's key when --api-key is not given; kvflow ignored
    the variable, so a vLLM deployment moved over came up with no authentication."""
    if env is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", env)
    assert _built_app_kwargs(monkeypatch, argv)["api_key"] == wanted


def test_serve_refuses_a_blank_vllm_api_key(capsys, monkeypatch):
    from kvflow.engine.llm_engine import LLMEngine

    def never(*args, **kwargs):
        raise AssertionError("the model loaded before VLLM_API_KEY was checked")

    monkeypatch.setattr(LLMEngine, "from_engine_args", never)
    monkeypatch.setenv("VLLM_API_KEY", "  ")
    line = _one_line_error(capsys, ["serve", "--port", "18294"], 2)
    assert "VLLM_API_KEY is blank" in line, line


def test_serve_takes_several_api_keys_as_vllm(monkeypatch):
    """vLLM's --api-key takes several keys (any of them is accepted); kvflow took one, and
    'kvflow serve --api-key k1 k2' read k2 as the MODEL."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    kwargs = _built_app_kwargs(monkeypatch, ["--api-key", "k1", "k2", "k1"])
    assert kwargs["api_key"] == ("k1", "k2")


def test_several_api_keys_need_one_engine(capsys, monkeypatch):
    from kvflow.engine.llm_engine import LLMEngine

    monkeypatch.setattr(LLMEngine, "from_engine_args", lambda *a, **k: (_ for _ in ()).throw(AssertionError()))
    line = _one_line_error(capsys, ["serve", "--port", "18295", "--api-key", "k1", "k2", "--data-parallel-size", "2"], 2)
    assert "--api-key: 2 keys need one engine (--data-parallel-size 1)" in line, line
