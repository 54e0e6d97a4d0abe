#!/usr/bin/env bash
# The quantization kernels checked on one GPU, from a prebuilt library (no cargo):
#   1. the C contract test (tests_c/test_api: bad inputs of every quantization function),
#      built with CMake;
#   2. python/tests/test_quantize.py (bit-exact against the torch reference, TE's scale and
#      delayed-scaling rules, transpose, dequantize, noop, end to end);
#   3. bench/quantize_bench.py (64M elements: GB/s, % of nominal and of a D2D copy, the
#      80 % bar).
#
# Usage: TE_COMM_LIB=<libtransformer_engine_comm.so> PYTHONPATH=python scripts/quant-gpu.sh
#   -h, --help  this text (no options otherwise)
# Environment:
#   TE_COMM_LIB     the prebuilt library (required)
#   OUT             output folder for the logs (default quant-gpu-out/)
#   QUANT_SKIP_C=1  skip step 1
# Needs: one Hopper GPU (H100 / H200: FP8); PyTorch with CUDA, pytest; CMake and a C
# compiler for step 1 (skipped without cmake).
# Takes: a few minutes (each step at most 600 s).
# Output: logs under $OUT, a table last; exit non-zero on any failure.
set -u
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
out=${OUT:-$root/quant-gpu-out}
mkdir -p "$out"
: "${TE_COMM_LIB:?set TE_COMM_LIB to the prebuilt libtransformer_engine_comm.so}"
export PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH}
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}
fail=0
rows=()
step() {  # step NAME CMD...
  local name=$1; shift
  local t0=$(date +%s)
  echo "=== $name: $*" | tee -a "$out/quant-gpu.log"
  timeout -k 10 600 "$@" >"$out/$name.log" 2>&1
  local rc=$?
  cat "$out/$name.log" >>"$out/quant-gpu.log"
  local res=PASS
  [ $rc -ne 0 ] && { res="FAIL (rc $rc)"; fail=1; tail -n 40 "$out/$name.log"; }
  rows+=("| $name | $res | $(( $(date +%s) - t0 )) s |")
}

# 1. C contract test (no GPU work, but built and run here too).
if [ -n "${QUANT_SKIP_C:-}" ]; then
  rows+=("| c_test_api | SKIPPED (QUANT_SKIP_C) | - |")
elif command -v cmake >/dev/null; then
  step c_build cmake -S "$root" -B "$out/build" -DTE_COMM_LIB="$TE_COMM_LIB" -DTE_COMM_GPU_TESTS=OFF
  step c_build2 cmake --build "$out/build" --target test_api -j 8
  step c_test_api "$out/build/tests_c/test_api"
else
  rows+=("| c_test_api | SKIPPED (no cmake) | - |")
fi
# 2. GPU tests.
step test_quantize python3 -m pytest -q -rs -p no:cacheprovider "$root/python/tests/test_quantize.py"
# 3. Benchmark.
step quantize_bench python3 "$root/bench/quantize_bench.py" --out "$out/quantize_bench.md"

echo
echo "| step | result | time |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
grep -E "passed|failed" "$out/test_quantize.log" | tail -n 1
[ -f "$out/quantize_bench.md" ] && { echo; cat "$out/quantize_bench.md"; }
exit $fail
