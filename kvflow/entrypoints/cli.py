"""The ``kvflow`` command line: ``generate``, ``chat``, ``serve``, ``memory``, ``quantize``.

The engine flags are made from the ``EngineArgs`` fields (name, type, default and the help
text in each field's metadata), so every option of ``LLM`` is a flag and none is listed by
hand. ``--help`` shows each flag's default. vLLM's ``LLM`` keywords are flags too, from
``kvflow.entrypoints.vllm_compat`` (``--gpu-memory-utilization``, ``--swap-space``,
``--trust-remote-code``...). No flag may be abbreviated.

Exit status: 0 on success; 2 for a usage or configuration error (an unknown flag, a bad
value, a model that does not exist or whose package is not installed, ``--device cuda``
without CUDA), printed as one line ``kvflow: error: ...``; 1 for a failure while running
(printed the same way; ``KVFLOW_TRACEBACK=1`` shows the traceback instead), among them
``serve`` on an address it cannot listen on (checked before the model loads); 130 after
Ctrl-C.

Progress messages of a cold start (converting a GGUF file, building a C++ kernel) go to
stderr as ``kvflow: ...`` unless ``--quiet`` (or ``KVFLOW_QUIET=1``): the library logs
them on the ``kvflow`` logger at INFO level, and the CLI prints that logger.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import signal
import sys
import threading
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

from kvflow import envs
from kvflow.config import KV_CACHE_DTYPE_NAMES
from kvflow.engine.arg_utils import EngineArgs
from kvflow.distributed.worker import torchrun_rank
from kvflow.entrypoints.openai.reasoning import REASONING_PARSERS
from kvflow.entrypoints.openai.tool_parsers import TOOL_PARSERS

# Errors that mean "the command was asked for something wrong" (exit status 2); a model or
# option kvflow does not run (NotImplementedError: an unknown GGUF architecture) is one too.
USAGE_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, ModuleNotFoundError, NotImplementedError)


def version() -> str:
    """kvflow's version: the installed distribution's, else the package's ``__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvflow")
    except PackageNotFoundError:
        import kvflow

        return kvflow.__version__


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``kvflow: error: ...`` (exit 2), and which
    takes no abbreviated flags (argparse's prefix matching read vLLM's ``--swap-space 4`` as
    ``--swap-space-bytes 4``: 4 bytes); every parser and subparser of the CLI is one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"kvflow: error: {message} (see '{self.prog} --help')\n")


class _Formatter(argparse.HelpFormatter):
    """Adds "(default: X)" to every flag with a default other than None that its help does
    not already state."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "%(default)" not in text
            and "default:" not in text
            and not any(action.default is v for v in (None, argparse.SUPPRESS, False))
            and action.option_strings
        ):
            text += " (default: %(default)s)"
        return text


def _json_object(name: str):
    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{name} must be a JSON object, got {text!r}")
        return value

    return parse


def _byte_size(name: str, minimum: int = 0):
    """A byte size with units (``512MiB``), at least ``minimum`` bytes (refused at parse time,
    before a model loads)."""
    def parse(text: str) -> int:
        from kvflow.utils import parse_bytes

        try:
            value = parse_bytes(text, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum} byte{'s' if minimum != 1 else ''}, got {value}")
        return value

    return parse


# Counts vLLM's CLI reads with a k / m / g / t suffix (its ``human_readable_int``: lower
# case decimal, 25.6k = 25,600; upper case binary, 1K = 1,024), so ``--max-model-len 32k`` as there.
_HUMAN_INT_FIELDS = ("max_model_len", "max_num_batched_tokens")
_HUMAN_INT_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _human_int(text: str) -> int:
    """An integer, or one with vLLM's k / m / g / t (decimal) or K / M / G / T (binary)
    suffix: ``32k`` is 32,000, ``25.6k`` 25,600, ``32K`` 32,768 (a binary suffix takes a whole
    number, as vLLM's)."""
    value = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (an integer, or one with a k / m / g / t "
                                             "or K / M / G / T suffix such as 32k)") from None
    number, suffix = match.groups()
    if suffix.isupper() and "." in number:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (a binary suffix such as K takes a whole "
                                         "number: 32K; 25.6k is 25,600)")
    return int(float(number) * _HUMAN_INT_SUFFIXES[suffix]) if "." in number else int(number) * _HUMAN_INT_SUFFIXES[suffix]


def _positive_count(text: str) -> int:
    """An integer >= 1 (refused at parse time)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    """A number of seconds > 0 (refused at parse time, before a model loads: ``nan``, 0 and
    negative values are not)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:  # (NaN is not > 0)
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _port(text: str) -> int:
    """``--port``: a TCP port, 1-65535 (refused at parse time, before a model loads)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1-65535, got {port}")
    return port


def _served_name(text: str) -> str:
    """A ``--served-model-name``: a model id a client can send (not empty or blank, no
    surrounding blanks)."""
    if not text.strip() or text != text.strip():
        raise argparse.ArgumentTypeError(f"a model name, not empty and without surrounding blanks: {text!r}")
    return text


def _api_key(text: str) -> str:
    """``--api-key``: not empty or blank (``--api-key "$KEY"`` with KEY unset would otherwise
    guard the server with a key every client already sends)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the API key must not be empty or blank")
    return text


def _api_key_from_env(value: str) -> str:
    """VLLM_API_KEY as ``--api-key`` (blank is a usage error naming it, as ``--api-key " "`` is)."""
    if not value.strip():
        raise ValueError("VLLM_API_KEY is blank: an API key must not be; unset it or set a key")
    return value


class ListenError(OSError):
    """``kvflow serve`` cannot listen on its ``--host``/``--port``."""


def check_bindable(host: str, port: int) -> None:
    """Bind (and close) a socket on every address of ``host``:``port`` the way the server
    will (asyncio's ``create_server``, which uvicorn calls: SO_REUSEADDR, IPv6 sockets
    v6-only), so that an address in use is reported before the model loads.

    Raises:
        ListenError: naming the address and the OS's reason (e.g. address already in
            use, or a host that does not resolve or is not this machine's).
    """
    import socket

    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise ListenError(f"cannot listen on {where}: --host does not resolve ({exc.strerror or exc})") from None
    for family, kind, proto, _, address in dict.fromkeys((i[0], i[1], i[2], None, i[4]) for i in infos):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                hint = "; stop the process using it or choose another --port" if exc.errno == errno.EADDRINUSE else ""
                raise ListenError(f"cannot listen on {where}: {exc.strerror or exc}{hint}") from None


_LORA_MODULE_KEYS = {"name", "path", "base_model_name", "is_3d_lora_weight"}


def _lora_module(text: str) -> list[tuple[str, str, str | None]]:
    """One ``--lora-modules`` entry, as vLLM's: NAME=PATH, or JSON: an object ``{"name",
    "path", "base_model_name"}`` or a list of them. Returns (name, path, base_model_name)
    for each adapter (base_model_name None where it is not given)."""
    if "=" in text and "," not in text:
        name, _, path = text.partition("=")
        if not name or not path:
            raise argparse.ArgumentTypeError(f"--lora-modules takes NAME=PATH entries, got {text!r}")
        return [(name, path, None)]
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lora-modules takes NAME=PATH or JSON entries such as "
                                         f'\'{{"name": "sql", "path": "/adapters/sql"}}\', got {text!r}') from None
    entries = value if isinstance(value, list) else [value]
    out = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise argparse.ArgumentTypeError(f"--lora-modules: a JSON entry is an object with name and path, got "
                                             f"{json.dumps(entry)}")
        unknown = sorted(set(entry) - _LORA_MODULE_KEYS)
        if unknown:
            raise argparse.ArgumentTypeError(f"--lora-modules: unknown field(s) {', '.join(unknown)} in {text!r} "
                                             f"(known: {', '.join(sorted(_LORA_MODULE_KEYS))})")
        name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise argparse.ArgumentTypeError(f"--lora-modules: each JSON entry needs a non-empty name and path, "
                                             f"got {json.dumps(entry)}")
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError(f"--lora-modules: base_model_name must be a string, got {base!r}")
        if entry.get("is_3d_lora_weight", False) is not False:
            raise argparse.ArgumentTypeError("--lora-modules: is_3d_lora_weight is not supported by kvflow (PEFT "
                                             "adapters of 2-D weights only)")
        out.append((name, path, base))
    return out


def _field_flag(group: argparse._ArgumentGroup, f: Field) -> None:
    """One flag for one ``EngineArgs`` field (``--block-size`` for ``block_size``)."""
    meta = f.metadata
    flag = "--" + f.name.replace("_", "-")
    kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
    kind = str(f.type).replace(" ", "")
    if meta.get("byte_size"):
        kwargs.update(type=_byte_size(f.name), metavar="BYTES")
    elif kind == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction
    elif kind == "bool|str":  # --quantize-lm-head (True), plus the flag that names a scheme
        kwargs["action"] = "store_true"
        group.add_argument(meta["method_flag"], dest=f.name, choices=meta["choices"], default=argparse.SUPPRESS,
                           help=f"quantize the LM head with this scheme (implies {flag})")
    elif kind.startswith("dict"):
        kwargs["type"] = _json_object(f.name)
    elif kind.startswith("int"):
        kwargs["type"] = _human_int if f.name in _HUMAN_INT_FIELDS else int
    elif kind.startswith("float"):
        kwargs["type"] = float
    if "choices" in meta and kind != "bool|str":
        kwargs["choices"] = meta["choices"]
    if "metavar" in meta:
        kwargs["metavar"] = meta["metavar"]
    assert f.default is not MISSING, f.name
    group.add_argument(flag, **kwargs)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (the options of LLM / EngineArgs)")
    for f in fields(EngineArgs):
        _field_flag(group, f)


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None


def _add_vllm_args(parser: argparse.ArgumentParser, serve: bool = False) -> None:
    """vLLM's flags of the options ``LLM`` takes as vLLM keywords (``vllm_compat``: the one
    list of them, with the CLI's value kinds), and on ``serve`` vLLM's server flags that
    change nothing in kvflow (``vllm_compat.SERVE_IGNORED``). A flag kvflow's command has
    already (``serve --served-model-name``, ``--data-parallel-size``) stays kvflow's. The
    flags given are translated as ``LLM(**kwargs)`` translates them (``_engine_kwargs``)."""
    from kvflow.entrypoints import vllm_compat as compat

    group = parser.add_argument_group(
        "vLLM's flags (mapped to kvflow's options, accepted without effect, or refused when set to what kvflow "
        "cannot honour: kvflow.entrypoints.vllm_compat)")
    names = sorted(compat.vllm_option_names()) + (sorted(compat.SERVE_IGNORED) if serve else [])
    added = []
    for name in names:
        flag = "--" + name.replace("_", "-")
        if flag in parser._option_string_actions:
            continue
        if name in compat.MAPPED:
            text = compat.MAPPED[name]
        elif name in compat.REFUSED_UNLESS:
            allowed, why = compat.REFUSED_UNLESS[name]
            values = " or ".join(repr(v) for v in allowed if v is not None)
            text = f"accepted only as {values} ({why})" if values else why
        else:
            text = f"no effect: {compat.IGNORED.get(name) or compat.SERVE_IGNORED[name]}"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": f"vLLM's; {text}"}
        kind = compat.CLI_VALUE[name]
        if kind == "flag":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind == "strs":
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = {"str": str, "int": int, "float": float, "json": _json_value}[kind]
        group.add_argument(flag, **kwargs)
        added.append(name)
    parser.set_defaults(vllm_flags=tuple(added))


def _vllm_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM flags given (name -> value)."""
    return {name: getattr(args, name) for name in getattr(args, "vllm_flags", ()) if hasattr(args, name)}


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="max new tokens per reply")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens of this total probability")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 or -1 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top probability")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineArgs`` / ``LLM`` keyword arguments of the parsed flags (all fields), vLLM's
    flags translated (``vllm_compat.translate_llm_kwargs``, logging a note for each).

    Raises:
        ValueError: naming the flag's option, for a vLLM flag set to a value kvflow cannot
            honour (see ``translate_llm_kwargs``).
    """
    from kvflow.entrypoints import vllm_compat

    kwargs = {f.name: getattr(args, f.name) for f in fields(EngineArgs)}
    given = {k: v for k, v in _vllm_flags(args).items() if k not in vllm_compat.SERVE_IGNORED}
    if not given:
        return kwargs
    return vllm_compat.translate_llm_kwargs(args.model, {**kwargs, **given}, set(kwargs))


def _sampling_params(args: argparse.Namespace):
    from kvflow.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        ignore_eos=args.ignore_eos,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvflow import LLM

    params = _sampling_params(args)
    llm = LLM(**_engine_kwargs(args))
    prompts = list(args.prompt)
    if args.chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=not args.quiet)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    for prompt, out in zip(prompts, outputs):
        if len(prompts) > 1:
            print(f"=== {prompt}")
        print(out.outputs[0].text)
    return 0


def stream_reply(llm, prompt: dict[str, Any], params, out=None) -> tuple[str, bool]:
    """Stream one reply to ``out`` (default stdout) as its tokens come.

    Ctrl-C (SIGINT) while it streams stops this reply only: the signal sets a flag that is
    read after each token, so a model step is never cut in the middle, and closing the
    stream aborts the request (its KV blocks are freed before the next step).

    Returns:
        (the reply's text so far, whether Ctrl-C stopped it).
    """
    out = out or sys.stdout
    stop = threading.Event()
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set()) if in_main else None
    stream = llm.generate_stream(prompt, params)
    text, printed = "", 0
    try:
        for output in stream:
            text = output.outputs[0].text
            out.write(text[printed:])
            out.flush()
            printed = len(text)
            if stop.is_set():
                break
    except KeyboardInterrupt:  # off the main thread, or before the handler took over
        stop.set()
    finally:
        stream.close()  # an unfinished request is aborted here
        if in_main:
            signal.signal(signal.SIGINT, previous)
    return text, stop.is_set()


def _cmd_chat(args: argparse.Namespace) -> int:
    """An interactive conversation. Ctrl-C during a reply stops that reply and keeps the
    conversation (with the part of the reply that was shown); an empty line is ignored;
    Ctrl-D, or Ctrl-C twice in a row at the prompt, quits. A conversation that outgrows the
    context lets go of its oldest exchanges (the system message stays); a turn the engine or
    the chat template refuses (too long by itself; a line that is not valid UTF-8) is
    refused with its message, and the session goes on without it."""
    from kvflow import LLM

    params = _sampling_params(args)
    llm = LLM(**_engine_kwargs(args))
    max_model_len = llm.engine.scheduler_config.max_model_len  # a prompt must be shorter
    if hasattr(sys.stdin, "reconfigure"):
        # Bytes that are not UTF-8 arrive as lone surrogates (refused below, per turn) under
        # every locale: a strict UTF-8 stdin (en_US.UTF-8) raised in input() and ended the session.
        sys.stdin.reconfigure(errors="surrogateescape")
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("kvflow chat: Ctrl-C stops a reply; Ctrl-D (or Ctrl-C twice at the prompt) quits.", file=sys.stderr)
    interrupted_at_prompt = False
    while True:
        try:
            user = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            if interrupted_at_prompt:
                print(file=sys.stderr)
                return 0
            interrupted_at_prompt = True
            print("\n(Ctrl-C again or Ctrl-D to quit)", file=sys.stderr)
            continue
        interrupted_at_prompt = False
        if not user.strip():
            continue
        # the turn on a copy: a refused turn leaves the conversation as it was (a turn too
        # long by itself used to drop every earlier exchange before it was refused)
        turn = [*history, {"role": "user", "content": user}]
        first = 1 if turn[0]["role"] == "system" else 0
        try:
            ids = llm.apply_chat_template(turn)
            dropped = 0
            while len(ids) >= max_model_len and len(turn) - first > 2:  # an older exchange to let go of
                del turn[first:first + 2]
                dropped += 1
                ids = llm.apply_chat_template(turn)
            if len(ids) < max_model_len:  # (else the engine refuses the turn: nothing is dropped)
                for _ in range(dropped):
                    print("(the oldest exchange was dropped to fit the context)", file=sys.stderr)
            text, stopped = stream_reply(llm, {"prompt_token_ids": ids}, params)
        except ValueError as exc:
            # this turn is refused (too long by itself, text that is not valid UTF-8, which
            # input() hands over as lone surrogates): the session goes on without it
            print(f"kvflow: error: {exc}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        if stopped:
            print("[reply stopped]", file=sys.stderr)
        if text:
            history = [*turn, {"role": "assistant", "content": text}]
        # (stopped before its first token: the turn is forgotten)


def _cmd_memory(args: argparse.Namespace) -> int:
    """KV cache sizes of a model from its config alone (see ``kvflow.entrypoints.memory_report``)."""
    from kvflow.entrypoints import memory_report as memory

    spec = memory.load_kv_spec(args.model)
    report = memory.memory_report(
        spec,
        args.kv_cache_dtype,
        block_size=args.block_size,
        budget_bytes=args.budget,
        max_model_len=args.max_model_len,
    )
    weights = memory.weight_report(args.model)
    if weights is not None:
        report["weights"] = weights
    text = memory.format_report(report) + ("" if weights is None else "\n\n" + memory.format_weights(weights))
    print(json.dumps(report, indent=2) if args.json else text)
    return 0


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the value itself when it is a Jinja template
    (holds ``{{`` or ``{%``), as vLLM's flag.

    Raises:
        FileNotFoundError: for a value that is neither.
    """
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(f"--chat-template: no such file, and not a Jinja template: {value!r}")


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from kvflow.engine.async_engine import AsyncLLMEngine
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.entrypoints.openai.server import build_app, default_served_name, make_server

    if args.model_tag is not None:
        if args.model not in (EngineArgs.model, args.model_tag):
            raise ValueError(f"the model is given twice ({args.model_tag!r} and --model {args.model!r}); give it once")
        args.model = args.model_tag
    if not args.quiet:
        logging.getLogger("kvflow").setLevel("DEBUG" if args.log_level == "trace" else args.log_level.upper())
    entries = [entry for given in args.lora_modules or [] for entry in given]
    lora_modules = {name: path for name, path, _ in entries}
    vllm_key = envs.read("VLLM_API_KEY")  # (empty: no key, as vLLM reads it)
    if args.api_key is None and vllm_key:
        # vLLM's server takes its key from VLLM_API_KEY when --api-key is not given: a vLLM
        # deployment moved over as it is must not come up without the key it relies on.
        args.api_key = [_api_key_from_env(vllm_key)]
        logging.getLogger(__name__).info("the API key is VLLM_API_KEY's, as vLLM's server takes it (--api-key wins)")
    api_keys = tuple(dict.fromkeys(args.api_key)) if args.api_key else None
    if api_keys is not None and len(api_keys) > 1 and args.data_parallel_size != 1:
        raise ValueError(f"--api-key: {len(api_keys)} keys need one engine (--data-parallel-size 1): the router in front "
                         "of the replicas takes one key")
    args.api_key = api_keys[0] if api_keys is not None else None  # (the router's key with --data-parallel-size)
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if len(lora_modules) != len(entries):
        raise ValueError("--lora-modules names an adapter twice")
    base_names = {*(args.served_model_name or [default_served_name(args.model)]), args.model}
    for name, _, base in entries:
        if base is not None and base not in base_names:
            raise ValueError(f"--lora-modules: adapter {name!r} has base_model_name {base!r}, which is not the served "
                             f"model (one of {', '.join(map(repr, sorted(base_names)))}): kvflow serves one base model; "
                             "leave base_model_name unset or name it")
    clash = next((name for name in lora_modules if name in base_names), None)
    if clash is not None:  # (build_app refused it as "lora_name: ..." once the model had loaded)
        raise ValueError(f"--lora-modules: {clash!r} is a name of the base model (--served-model-name / --model); "
                         "give the adapter a name of its own")
    if args.data_parallel_size == 1:  # one engine, no router: a router flag would do nothing
        given = [flag for flag in ("--router", "--router-policy")
                 if any(a == flag or a.startswith(flag + "=") for a in args.argv)]
        if given:
            raise ValueError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --data-parallel-size N with "
                             "N > 1 (the router runs in front of the replicas; one engine runs without one)")
    chat_template = load_chat_template(args.chat_template)  # a missing file: before the model loads
    check_bindable(args.host, args.port)  # before the model loads (seconds to minutes)
    if args.data_parallel_size != 1:  # N replicas behind a router (kvflow/entrypoints/data_parallel.py)
        from kvflow.entrypoints.data_parallel import DataParallelArgs, serve_data_parallel

        DataParallelArgs(args.data_parallel_size, args.router, args.router_policy).validate()
        # The engine's own options (a model that does not exist, --max-num-seqs 0, a vLLM flag
        # kvflow cannot honour, ...), checked here as one engine checks them before it loads:
        # each replica found them only after every replica had started (exit 1, the error
        # printed once per replica). create_config reads the model's config, not its weights;
        # the replicas' KV pools must fit the available memory together (each alone checked
        # only its own against memory the others were about to take).
        EngineArgs(**_engine_kwargs(args)).create_config(replicas=args.data_parallel_size)
        return serve_data_parallel(args, args.argv[args.argv.index("serve"):])
    from kvflow.entrypoints import vllm_compat

    vllm_compat.note_serve_options({k: v for k, v in _vllm_flags(args).items() if k in vllm_compat.SERVE_IGNORED})
    engine = LLMEngine.from_engine_args(EngineArgs(**_engine_kwargs(args)))
    served = list(dict.fromkeys(args.served_model_name or [default_served_name(args.model)]))  # (repeats: once)
    name = served[0]  # (vLLM's: the first name is the one reported; each is accepted)
    server = None

    def on_dead(exc: BaseException) -> None:  # the engine thread: stop serving, exit non-zero
        if server is not None:
            server.should_exit = True

    async_engine = AsyncLLMEngine(engine, name, max_queue_len=args.max_queue_len, on_dead=on_dead)
    app = build_app(
        async_engine, name, engine.scheduler_config.max_model_len, api_key=api_keys,
        metrics_need_key=not args.metrics_no_auth, max_request_bytes=args.max_request_bytes, model_aliases=(args.model,),
        served_model_names=tuple(served[1:]),
        chat_template=chat_template, tool_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, lora_modules=lora_modules,
    )  # fmt: skip
    server = make_server(app, args.host, args.port, args.uvicorn_log_level or args.log_level, args.timeout_keep_alive,
                         args.request_read_timeout)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn's STARTUP_FAILURE (3): e.g. the port was taken meanwhile
        if exc.code in (0, None):
            raise
        check_bindable(args.host, args.port)  # names the address and the reason, if that is it
        raise RuntimeError(f"the HTTP server did not start on {args.host}:{args.port} (uvicorn exit status "
                           f"{exc.code}; its log above says why)") from None
    if async_engine.error is not None:
        print(f"kvflow: error: the engine stopped ({async_engine.error!r}); exiting so that a supervisor restarts "
              "the server", file=sys.stderr)
        return 1
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    import torch

    from kvflow.model.loader import load_model, quantize_model
    from kvflow.model.resolve import load_tokenizer, resolve_model
    from kvflow.quantization.awq import calibration_tokenizer, default_calibration_ids
    from kvflow.quantization.checkpoint import quantization_of, save_quantized, weight_bytes

    if args.method == "int4-rtn":
        args.method = "int4"
    # Every refusal before the model loads (a mistake costs no load, nothing is written).
    if args.method != "int4-awq" and (args.calibration is not None or args.calibration_tokens is not None):
        raise ValueError(f"--calibration / --calibration-tokens are for --method int4-awq, not {args.method}")
    if args.method in ("int8", "fp8") and args.group_size is not None:
        raise ValueError(f"--group-size is for the INT4 methods, not {args.method}")
    if args.calibration is not None and not os.path.isfile(args.calibration):
        raise ValueError(f"--calibration: no such file: {args.calibration}")
    out_path = Path(args.out)
    if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())):
        raise ValueError(f"--out {args.out} exists and is not an empty folder; give a new one")
    model_dir = resolve_model(args.model)
    done = quantization_of(model_dir)
    if done is not None:
        raise ValueError(f"{args.model} is already quantized ({done.get('method')}); quantize the float model it came from")
    group_size = args.group_size if args.group_size is not None else 32
    tokens = args.calibration_tokens if args.calibration_tokens is not None else 512
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    before = weight_bytes(model)
    calibration = None
    if args.method == "int4-awq":
        tokenizer = calibration_tokenizer(lambda: load_tokenizer(model_dir))
        if args.calibration:
            with open(args.calibration, encoding="utf-8") as f:
                calibration = tokenizer.encode(f.read())[:tokens]
        else:
            calibration = default_calibration_ids(tokenizer, tokens)
    quantize_model(model, args.method, group_size, calibration)
    out = save_quantized(model, model_dir, args.out, args.method, group_size)
    print(f"wrote {out}: {args.method}, weights {before / 2**20:.1f} MiB -> {weight_bytes(model) / 2**20:.1f} MiB")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvflow", description="kvflow: LLM inference engine", formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"kvflow {version()}")
    common = _Parser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", default=envs.KVFLOW_QUIET,
                        help="no progress messages on stderr (GGUF conversion, kernel builds, progress bars); "
                        "also KVFLOW_QUIET=1")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub_parser = sub.add_parser(name, help=help, description=help, parents=[common], formatter_class=_Formatter)
        sub_parser.set_defaults(command_parser=sub_parser)  # its errors point to its own --help
        return sub_parser

    defaults = EngineArgs()
    gen = command("generate", "generate completions for prompts")
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    gen.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user message in the chat template")
    _add_engine_args(gen)
    _add_vllm_args(gen)
    _add_sampling_args(gen, max_tokens=64)
    gen.set_defaults(func=_cmd_generate)

    chat = command("chat", "interactive chat, printing tokens as they are generated (Ctrl-C stops a reply, "
                   "Ctrl-D quits)")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_engine_args(chat)
    _add_vllm_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=_cmd_chat)

    quant = command("quantize", "write a weight-quantized checkpoint that LLM(model=DIR) loads")
    quant.add_argument("--model", default=defaults.model, help=EngineArgs.help_text("model"))
    quant.add_argument("--method", required=True, choices=["int8", "int4", "int4-rtn", "int4-awq", "fp8"])
    quant.add_argument("--group-size", type=int, default=None, choices=[32, 64, 128],
                       help="INT4 group size (default 32; INT4 methods only)")
    quant.add_argument("--calibration", default=None, help="text file for AWQ (default: the GPL-3 text)")
    quant.add_argument("--calibration-tokens", type=_positive_count, default=None,
                       help="AWQ calibration tokens (default 512)")
    quant.add_argument("--out", required=True, help="output folder (new, or empty)")
    quant.set_defaults(func=_cmd_quantize)

    serve = command("serve", "OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as --model (vLLM's `vllm serve MODEL`)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--port", type=_port, default=8000, help="TCP port, 1-65535; checked free before the model loads")
    serve.add_argument("--api-key", type=_api_key, nargs="+", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every path but /health (see --metrics-no-auth); "
                       "as vLLM's, several keys: any of them is accepted (default: VLLM_API_KEY's, when set)")
    serve.add_argument("--metrics-no-auth", action="store_true",
                       help="with --api-key, leave /metrics (and the routers' /get_load) open too")
    serve.add_argument("--served-model-name", nargs="+", type=_served_name, default=None, metavar="NAME",
                       help="model id in the API (default: the --model short name, file stem or folder name); as "
                       "vLLM's, several names: the first is the one responses and /v1/models report, every one is "
                       "accepted as a request's model")
    serve.add_argument("--max-queue-len", type=_positive_count, default=None,
                       help="at most this many requests accepted and not yet running; more get 429 (a request with more "
                       "prompts than this gets 400: it could never fit) (default: no limit)")
    serve.add_argument("--max-request-bytes", type=_byte_size("max_request_bytes", minimum=1), default="10MiB", metavar="BYTES",
                       help="larger request bodies get 413 (default: 10MiB)")
    serve.add_argument("--timeout-keep-alive", type=_positive_seconds, default=5.0,
                       help="close a keep-alive connection idle this many seconds between requests (default: 5)")
    serve.add_argument("--request-read-timeout", type=_positive_seconds, default=30.0,
                       help="close a connection whose request (headers and body) has not arrived this many seconds "
                       "after its first byte, or after the connection opened (default: 30)")
    serve.add_argument("--log-level", default="info", type=str.lower,
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's and kvflow's log level")
    serve.add_argument("--uvicorn-log-level", default=None, type=str.lower,
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level alone (vLLM's flag; default: --log-level)")
    serve.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) used instead of the tokenizer's")
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how tool calls are read from the model's text under tool_choice 'auto' (default: the "
                       "family the chat template shows, e.g. hermes for a template with <tool_call>; generic otherwise, which "
                       "reads <tool_call> blocks, bare JSON calls and ```json fences)")
    serve.add_argument("--lora-modules", nargs="+", default=None, type=_lora_module, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) served as models of their own: a request whose model is "
                       "NAME runs with the adapter at PATH (needs --enable-lora; see docs/lora.md); or vLLM's JSON "
                       "form, '{\"name\": NAME, \"path\": PATH, \"base_model_name\": MODEL}' (MODEL: the served "
                       "model) or a list of such objects")
    serve.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split <think>...</think> into reasoning_content (default: no split)")
    _add_engine_args(serve)
    from kvflow.entrypoints.data_parallel import DataParallelArgs

    group = serve.add_argument_group("replicas (data parallelism behind a router, docs/scale-out.md)")
    for f in fields(DataParallelArgs):
        _field_flag(group, f)
    _add_vllm_args(serve, serve=True)
    serve.set_defaults(func=_cmd_serve)

    mem = command("memory", "KV cache bytes per token/block, attention variants, what a budget holds; weight bytes as stored")
    mem.add_argument("--model", default=defaults.model, help="short name, .gguf file or HF directory (only its config is read)")
    mem.add_argument("--max-model-len", type=int, default=None, help="request length in tokens (default: the model's context)")
    mem.add_argument(
        "--kv-cache-dtype", default="auto",
        choices=KV_CACHE_DTYPE_NAMES,
        help="KV element type (auto: the engine's default --dtype here: bfloat16 on CUDA and on a CPU with native "
        "bfloat16, AVX512-BF16 / AMX-BF16, float32 on other CPUs; an engine run with another --dtype has a cache "
        "of that dtype: pass it as --kv-cache-dtype)",
    )
    mem.add_argument("--budget", type=_byte_size("budget"), default="512MiB", metavar="BYTES",
                     help="KV cache budget: bytes or 512MiB, 8GiB, 2GB")
    mem.add_argument("--block-size", type=int, default=defaults.block_size, help=EngineArgs.help_text("block_size"))
    mem.add_argument("--json", action="store_true", help="print the report as JSON")
    mem.set_defaults(func=_cmd_memory)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _CliFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"kvflow: {level}{record.getMessage()}"


def configure_logging(quiet: bool) -> None:
    """Print the ``kvflow`` logger to stderr (``kvflow: ...``): INFO and up (progress of a
    cold start), or only warnings and errors when ``quiet``. Idempotent."""
    logger = logging.getLogger("kvflow")
    logger.handlers = [h for h in logger.handlers if not isinstance(h, _StderrHandler)]
    handler = _StderrHandler()
    handler.setFormatter(_CliFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)


def _fail(code: int, exc: BaseException) -> None:
    message = " ".join(str(exc).split()) or type(exc).__name__
    if code == 1:
        message = f"{type(exc).__name__}: {message} (KVFLOW_TRACEBACK=1 shows the traceback)"
    print(f"kvflow: error: {message}", file=sys.stderr)
    raise SystemExit(code)


# llama-server's flags (a llama.cpp user's habits) -> what kvflow takes instead, named in the
# "unrecognized arguments" error
_LLAMA_SERVER_FLAGS = {
    "-m": "the model as the first argument or --model", "-c": "--max-model-len", "--ctx-size": "--max-model-len",
    "-t": "--num-threads", "--threads": "--num-threads", "-np": "--max-num-seqs", "--parallel": "--max-num-seqs",
    "-b": "--max-num-batched-tokens", "--batch-size": "--max-num-batched-tokens",
    "-ub": "--max-num-batched-tokens", "--ubatch-size": "--max-num-batched-tokens",
    "-a": "--served-model-name", "--alias": "--served-model-name",
    "-n": "each request's max_tokens", "--n-predict": "each request's max_tokens",
    "-ngl": "--device cuda (the whole model)", "--n-gpu-layers": "--device cuda (the whole model)",
    "--jinja": "nothing: the chat template is always rendered as Jinja",
    "-cb": "nothing: batching is always continuous", "--cont-batching": "nothing: batching is always continuous",
}  # fmt: skip


def _unrecognized(extra: list[str]) -> str:
    """The "unrecognized arguments" message, with kvflow's flag for each of llama-server's."""
    hints = {}
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name in _LLAMA_SERVER_FLAGS:
            hints[name] = _LLAMA_SERVER_FLAGS[name]
    message = f"unrecognized arguments: {' '.join(extra)}"
    if hints:
        message += "; llama-server's " + ", ".join(f"{name} is {alt}" for name, alt in hints.items()) + " here"
    return message


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvflow`` console script (exit status: see the module docstring).

    Raises:
        SystemExit: with status 2 (usage or configuration error) or 1 (runtime failure),
            after printing one line ``kvflow: error: ...``.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # (the top parser would say "see 'kvflow --help'" for a subcommand's mistake)
        getattr(args, "command_parser", parser).error(_unrecognized(extra))
    args.argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging(args.quiet)
    try:
        rank = torchrun_rank()
        if rank is not None and rank[0] != 0 and hasattr(args, "tensor_parallel_size"):
            # A non-zero torchrun rank serves the driver's steps on its shard; only rank 0
            # runs the command itself (the engine, the server, the CLI output).
            from kvflow.distributed.worker import worker_main
            from kvflow.worker.worker import build_rank

            worker_main(rank[0], rank[1], "env://", EngineArgs(**_engine_kwargs(args)), build_rank)
            return 0
        return args.func(args)
    except KeyboardInterrupt:
        print("kvflow: interrupted", file=sys.stderr)
        return 130
    except USAGE_ERRORS as exc:
        _fail(2, exc)
    except Exception as exc:  # noqa: BLE001 - one line instead of a traceback
        if envs.KVFLOW_TRACEBACK:
            raise
        _fail(1, exc)
    return 1  # unreachable: _fail raises


if __name__ == "__main__":
    sys.exit(main())
