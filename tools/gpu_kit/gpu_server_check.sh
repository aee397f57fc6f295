#!/usr/bin/env bash
# The first real SGLang GPU server check with this plugin (issue 27), for one lent H200: at most
# 9 minutes, each step with its own time limit, every output under $OUT. NOT YET RUN ON A GPU.
#   1. install the kit's wheels (tools/gpu_kit/build.py builds gpu-kit/; the device has no network)
#   2. import smoke: SGLang's CUDA-path modules, both plugins loaded, and the check plugin's
#      Triton tree build + greedy verify against the CPU stand-in's reference on the GPU
#   3. build the permutation fixture on the device (torch only)
#   4. TP=1 EAGLE + token map + plugin server with CUDA graphs (draft decode and draft extend
#      captured): greedy chain, cold prompt, batch of 4 equal greedy decoding, accept length 3.0
#   5. the same server with --disable-cuda-graph: identical outputs and accept lengths
#   6. as time allows: tools/gpu_kit/gpu_check.sh (kernel tests, bench_head_gemm) into kernels.tar
# With the device tool: run(command="bash tools/gpu_kit/gpu_server_check.sh", carry=["gpu-kit"],
# timeout_s=580). Outputs: check.txt (every step's output), server_{graphs,eager}.{log,json},
# kernels.tar. `--dry-run` prints the steps and their limits and runs nothing.
set -uo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
out="${OUT:-out/gpu-server-check}"
budget=540         # seconds for the whole check
site=/tmp/frspec-gpu-kit-site  # the kit's wheels are installed here
cache=/tmp/frspec-gpu-fixtures # the fixture is built here (about 40 MB, not sent back)
dry_run=0
[ "${1:-}" = "--dry-run" ] && dry_run=1
log="$out/check.txt"
status=0
start=$SECONDS

# step NAME LIMIT_S COMMAND...: run COMMAND under its own limit (cut to what is left of the
# budget), its output appended to check.txt; a failed step marks the check failed.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - start)))
  if [ "$dry_run" = 1 ]; then
    echo "step $name: limit ${limit}s: $*"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "== $name: skipped, ${left}s of the budget left" | tee -a "$log"
    status=1
    return 1
  fi
  echo "== $name: limit ${limit}s, at $((SECONDS - start))s: $*" >>"$log"
  local began=$SECONDS rc
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - began))s" | tee -a "$log"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

export PYTHONUNBUFFERED=1
# The check's site (sgl_kernel stand-in, flash_mla stub, check plugin), the repository, the
# plugin's entry-point metadata, then the installed wheels.
export PYTHONPATH="$PWD/tools/gpu_kit/gpu_site:$PWD:$PWD/gpu-kit/site:$site${PYTHONPATH:+:$PYTHONPATH}"
device_env=$("$python" -m tools.gpu_kit.gpu_server_check env) || exit 1
eval "$device_env"
check=(-m tools.gpu_kit.gpu_server_check)
if [ "$dry_run" = 0 ]; then
  mkdir -p "$out"
  : >"$log"
fi

if [ "$dry_run" = 0 ] && ! compgen -G "gpu-kit/wheels/sglang-*.whl" >/dev/null; then
  echo "no gpu-kit/wheels here: build the kit (.venv/bin/python -m tools.gpu_kit.build) and carry gpu-kit" | tee -a "$log"
  exit 1
fi
# The required steps' limits add up to 525 s; the kernel step gets what is left.
step machine 15 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
if step install 60 "$python" -m pip install -q --no-index --no-deps --no-compile --upgrade \
  --target "$site" gpu-kit/wheels/*.whl; then
  step imports 75 "$python" "${check[@]}" imports --device cuda
  if step fixture 45 "$python" "${check[@]}" fixture "$cache"; then
    step graphs 210 "$python" "${check[@]}" serve "$cache" graphs "$out"
    step eager 120 "$python" "${check[@]}" serve "$cache" eager "$out"
  fi
fi
kernels=$(mktemp -d)
step kernels "$budget" env OUT="$kernels/kernels" PYTHON="$python" bash tools/gpu_kit/gpu_check.sh
[ -d "$kernels/kernels" ] && tar -C "$kernels" -cf "$out/kernels.tar" kernels
rm -rf "$kernels"

[ "$dry_run" = 1 ] && exit 0
echo "gpu_server_check: $( ((status)) && echo FAILED || echo passed) in $((SECONDS - start))s; outputs in $out"
exit "$status"
