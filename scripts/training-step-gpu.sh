#!/usr/bin/env bash
# The training-step check on one GPU, in one call:
#   - the quantization kernels: python/tests/test_quantize.py (bit-exact) and
#     bench/quantize_bench.py (bandwidth);
#   - the comm-GEMM FP8 accumulation test (test_comm_gemm_fp8: 1 rank, and 2 and 4 ranks
#     sharing the GPU over IPC);
#   - host cost per call: bench_host in C at tp 1 and with 2 ranks sharing the GPU, the public
#     torch ops at tp 1 (bench/host_cost.py);
#   - the torch modules' one-GPU tests, the optimizer's and the GEMM's, and test_graph (the
#     library GEMM's CUDA graphs, also under the users' own captures);
#   - the training step (scripts/step-bench-gpu.sh --iters 20 --warmup 4: FP8 vs bf16 with
#     both recipes, bf16 vs its GEMMs + optimizer, the library path forced at tp 1, host vs
#     GPU time at tp-4 shapes, CUDA graphs);
#   - the JAX example at tp 1 (examples/jax/mlp_with_overlap.py: the layers vs XLA's own
#     build and the library forced, bf16; FP8 with both recipes only with TE_COMM_JAX_FP8=1).
#
# Usage: scripts/training-step-gpu.sh
#   e.g. TE_COMM_LIB=/path/libtransformer_engine_comm.so OUT=/tmp/out scripts/training-step-gpu.sh
#   -h, --help  this text (no options otherwise)
# Environment:
#   TE_COMM_LIB        the library (else target/release, built by cargo when present)
#   OUT                output folder (default gpu-out/); everything goes to $OUT/training-step
#   PYTHON             the interpreter (default python3)
#   TE_COMM_STEP_ROWS  the training-step rows (default "parts bf16_ovl bf16_ref fp8d_ovl
#                      fp8c_ovl bf16_graph fp8d_graph bf16_forced tp4_forced tp4_ref")
#   TE_COMM_JAX_FP8=1  also the JAX FP8 rows (XLA's FP8 autotuning: 150 s or more each, more
#                      than one 10-minute device call has left)
# Needs: one Hopper GPU (H100 / H200); the CUDA runtime, NCCL, MPI and CMake (tests_c);
# PyTorch and JAX with CUDA; cargo only without TE_COMM_LIB.
# Takes: about 5-7 minutes on one H100 (300-420 s so far); each stage has its own limit.
# Output: a summary table printed last (also $OUT/training-step/summary.md); exit 1 when a
# stage failed (a missed bar is reported in the tables, not an error).
set -uo pipefail
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
out=${OUT:-$root/gpu-out}/training-step
mkdir -p "$out"
export PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH}
export CUDA_DEVICE_MAX_CONNECTIONS=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}
lib=$(te_comm_library) || exit 1
export TE_COMM_LIB=$lib
build=$root/build-gpu
t_start=$(date +%s)
te_comm_cmake_build "$lib" "$build" -DTE_COMM_GPU_TESTS=ON >"$out/build.log" 2>&1 || { tail -n 40 "$out/build.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader >"$out/device.txt" 2>&1
fail=0
rows=()
stage() {  # stage NAME LIMIT_S CMD...
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s) rc res
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  res=PASS
  [ $rc -eq 124 ] && res="FAIL (timeout)"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && res="FAIL (rc $rc)"
  [ "$res" = PASS ] || fail=1
  local note=$(grep -hE "[0-9]+ passed|^host-cost bar|^host_cost:|bar.*(PASS|FAIL)" "$out/$name.log" | tail -n 1 | cut -c1-110)
  rows+=("| $name | $res | ${note:--} | $(( $(date +%s) - t0 )) |")
}
mpi=$root/tests_c/run_mpi.sh
py=${PYTHON:-python3}

stage quantize_tests 120 "$py" -m pytest -q -rs -p no:cacheprovider "$root/python/tests/test_quantize.py"
stage quantize_bench 90 "$py" "$root/bench/quantize_bench.py" --out "$out/quantize_bench.md"
for np in 1 2 4; do stage "fp8_accum_np$np" 90 "$mpi" "$np" "$build/tests_c/test_comm_gemm_fp8"; done
stage host_c_tp1 90 "$mpi" 1 "$build/tests_c/bench_host" --small-only --out "$out/host_c_tp1.md"
stage host_c_tp2_shared 120 "$mpi" 2 "$build/tests_c/bench_host" --small-only --out "$out/host_c_tp2_shared.md"
stage host_torch_ops 90 "$py" "$root/bench/host_cost.py" --sizes 256 --out "$out/host_torch_ops.md"
stage modules_tp1 150 "$py" -m pytest -q -rs -p no:cacheprovider "$root/python/tests/torch/test_modules_tp1.py" \
  "$root/python/tests/torch/test_optim.py" "$root/python/tests/torch/test_gemm.py"
# The library GEMM's CUDA graphs (NVTE_COMM_GEMM_GRAPHS) under the users' own captures.
stage graph_capture_c 90 "$mpi" 1 "$build/tests_c/test_graph"
OUT=$out TE_COMM_STEP_ROWS=${TE_COMM_STEP_ROWS:-"parts bf16_ovl bf16_ref fp8d_ovl fp8c_ovl bf16_graph fp8d_graph bf16_forced tp4_forced tp4_ref"} \
  stage step 420 "$root/scripts/step-bench-gpu.sh" --iters 20 --warmup 4
ex=$root/examples/jax/mlp_with_overlap.py
stage jax_bf16 150 "$py" "$ex" --builds xla,layers,library --profile --profile-dir "$out/jax-traces"
# The JAX FP8 rows (no bar) only with TE_COMM_JAX_FP8=1: XLA's autotuning of the FP8 GEMMs
# takes 150 s or more per build (bench/RESULTS.md), which the 10-minute device call lacks.
if [ "${TE_COMM_JAX_FP8:-0}" = 1 ]; then
  stage jax_fp8_delayed 240 "$py" "$ex" --fp8-recipe delayed --builds layers --profile --profile-dir "$out/jax-traces"
  stage jax_fp8_current 240 "$py" "$ex" --fp8-recipe current --builds layers --profile --profile-dir "$out/jax-traces"
fi
rm -rf "$out/jax-traces"

{
  echo "device: $(cat "$out/device.txt")"
  for f in quantize_bench host_c_tp1 host_c_tp2_shared host_torch_ops; do
    [ -f "$out/$f.md" ] && { echo; echo "### $f"; cat "$out/$f.md"; }
  done
  grep -hE "max \|fast - full" "$out"/fp8_accum_np*.log
  [ -f "$out/step/summary.md" ] && { echo; echo "### training step (scripts/step-bench-gpu.sh)"; cat "$out/step/summary.md"; }
  echo; echo "### JAX example at tp 1"
  grep -h "^RESULT" "$out"/jax_*.log | cut -c1-400
  echo
  echo "| stage | result | note | seconds |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo "training-step-gpu: $(( $(date +%s) - t_start )) s"
} | tee "$out/summary.md"
exit $fail
