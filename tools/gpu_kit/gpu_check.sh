#!/usr/bin/env bash
# One prepared GPU check (issue 13), for a machine with CUDA torch + triton (SGLang not needed):
# the CUDA-graph tests and the kernel tests natively, then the per-rank head benchmark with the
# Triton kernels (GEMV, packet, GEMV+packet) next to torch. About 5 minutes on an H200; each
# step has its own time limit so the whole stays under 8 minutes.
#   bash tools/gpu_kit/gpu_check.sh            # outputs under $OUT if set, else docs/results/
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-docs/results}"
python="${PYTHON:-python}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, installed or not
status=0

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.memory --format=csv
  "$python" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$out/h200_kernels_machine.txt" 2>&1 || status=1

# Natively on the GPU (the interpreter run is CPU CI's job); no conftest: it needs the test stack.
timeout 240 "$python" -m pytest tests/test_gpu_graphs.py tests/test_kernels.py -v --noconftest \
  -p no:cacheprovider -k "not interpreter" 2>&1 | tee "$out/h200_kernels_tests.txt" || status=1

timeout 300 "$python" -m benchmarks.bench_head_gemm --device cuda --tp 1 2 4 8 --rows 1 8 64 --repeats 7 \
  --json "$out/h200_kernels_gemm.json" 2>&1 | tee "$out/h200_kernels_gemm.txt" || status=1

echo "gpu_check: outputs in $out (status $status)"
exit $status
