#!/usr/bin/env bash
# The prepared run for a CUDA machine (the GPU path of issue #8; docs/development.md "GPU path"):
# the GPU-relevant tests (Triton kernels against the PyTorch path, CUDA-graph replay against
# eager, bf16 kernels), then benchmarks/gpu_throughput.py. Logs and JSON go to $OUT
# (default benchmarks/results/gpu). About 5 minutes on an H200.
#
# A device machine without network lacks `gguf` (imported by kvflow's loader): download its
# wheel here into .whl/ first (python3 -m pip download --no-deps -d .whl gguf) and carry .whl;
# this script installs whatever .whl holds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" \
  2>&1 | tee -a "$OUT/gpu.txt"
# The C++ CPU kernels are not what this run checks (KVFLOW_CPU_KERNELS=0: the CPU references
# in these tests run PyTorch's operators and nothing is compiled for the host).
KVFLOW_CPU_KERNELS=0 timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/attention tests/worker \
  tests/platforms tests/test_config.py 2>&1 | tee "$OUT/tests.log"
tests=$?
timeout 300 python3 -m benchmarks.gpu_throughput --out "$OUT/gpu_throughput.json" 2>&1 | tee "$OUT/bench.log"
bench=$?
echo "tests rc=$tests benchmark rc=$bench" | tee -a "$OUT/gpu.txt"
exit $(( tests != 0 || bench != 0 ))
