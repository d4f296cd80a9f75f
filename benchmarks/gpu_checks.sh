#!/usr/bin/env bash
# Everything that needs a GPU, in one go (one CUDA device; 2.5 min on an H200):
#   the gpu-marked tests, then benchmarks/bench_cuda_graphs.py (null model and a GPT), into ${OUT:-.}/gpu_*.
# Run from the repository root, where torch with CUDA, pytest, pytest-xdist, tabulate and sympy are installed;
# it installs the checkout itself (pip install -e ., offline, no dependencies: zbcompile.passes is the passes/
# folder, which only an install maps). Each part has its own time limit, so one that hangs does not take the
# others along.
set -u
out=${OUT:-.}
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1   # zbcompile.passes is passes/
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
timeout "${GPU_TEST_S:-330}" python3 -m pytest -q -n 0 -m gpu -rA --durations=20 -p no:cacheprovider \
    tests/gpu tests/lower/test_offload.py tests/lower/test_memory_plan.py 2>&1 | tee "$out/gpu_tests.log"
echo "pytest status ${PIPESTATUS[0]}"
cd benchmarks
timeout 90 python3 bench_cuda_graphs.py --json "$out/gpu_bench_null.json" 2>&1 | tee "$out/gpu_bench.log"
timeout 90 python3 bench_cuda_graphs.py --model gpt --d 1024 --layers 8 --json "$out/gpu_bench_gpt.json" 2>&1 \
    | tee -a "$out/gpu_bench.log"
