#!/usr/bin/env bash
# One-GPU regression of a change that has not run on a GPU yet, in ONE device call of at
# most 10 minutes (a time budget skips, and reports, what would not fit):
#   1. the C/C++ GPU tests at 1 rank (test_api, test_teardown, test_gemm, test_overlap,
#      test_comm_gemm, test_graph) and the FP8 accumulation test with 1, 2 and 4 ranks
#      (2 and 4 sharing the GPU over IPC);
#   2. the reliability cases with 2 and 4 ranks sharing the GPU (IPC: the overlap API and
#      the comm-GEMM API with callback contexts): fault, mismatch, unchecked, and a short
#      soak and churn;
#   3. the JAX GPU tests with 1 and 2 processes sharing the GPU (when jax imports);
#   4. host cost per C call (bench_host: us and allocations per call, tp 1);
#   5. old against new at tp 1, same card, same call: bench_overlap and bench_comm_gemm
#      with the library and tests_c of an older tree in .mg/old (libtransformer_engine_comm.so
#      beside its CMakeLists.txt, cmake/, include/, tests_c/, scripts/common.sh), when there.
#
# Usage: TE_COMM_LIB=<libtransformer_engine_comm.so> scripts/regress-gpu.sh
#   -h, --help  this text (no options otherwise)
# Environment:
#   TE_COMM_LIB             the library (else target/release, built by cargo when present)
#   OUT                     output folder (default gpu-out/)
#   TE_COMM_REGRESS_BUDGET  seconds for everything (default 560)
# Needs: one GPU (Hopper for the FP8 and fused cases); the CUDA runtime, NCCL, MPI and CMake
# (tests_c); JAX with CUDA for step 3 (skipped without); cargo only without TE_COMM_LIB.
# Takes: up to TE_COMM_REGRESS_BUDGET (560 s), within one 10-minute device call.
# Output: logs and tables in one archive, results.tgz, beside summary.md under $OUT; the
# summary is printed last; exit 1 when a step failed.
set -uo pipefail
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
out=${OUT:-$root/gpu-out}
mkdir -p "$out/logs" "$out/tables"
budget=${TE_COMM_REGRESS_BUDGET:-560}
t_start=$(date +%s)
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
lib=$(te_comm_library) || exit 1
export TE_COMM_LIB=$lib
build=$root/build-gpu
mpi=$root/tests_c/run_mpi.sh
echo "GPUs: $(gpu_count) ($(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n1)); library $lib"
te_comm_cmake_build "$lib" "$build" -DTE_COMM_GPU_TESTS=ON || exit 1
fail=0
rows=()

for t in test_api test_teardown; do step "$t" 60 "$build/tests_c/$t"; done
for t in test_gemm test_overlap test_comm_gemm test_graph; do step "${t}_np1" 90 "$mpi" 1 "$build/tests_c/$t"; done
for np in 1 2 4; do step "test_comm_gemm_fp8_np$np" 60 "$mpi" "$np" "$build/tests_c/test_comm_gemm_fp8"; done
for np in 2 4; do
  step "reliability_shared_np$np" 150 "$build/tests_c/test_reliability" --ranks "$np" \
    --only fault,mismatch,unchecked,soak,churn --soak-calls 1000 --churn-cycles 10
done
# JAX with 1 and 2 processes sharing the GPU (process-local mode, the library's IPC).
if python3 -c 'import jax' 2>/dev/null; then
  step jax_shared_np1_2 150 env PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" TE_COMM_JAX_NP=1,2 \
    TE_COMM_JAX_SHARED=1 python3 -m pytest -q -rs -p no:cacheprovider "$root/python/tests/jax"
fi
step bench_host_tp1 60 "$mpi" 1 "$build/tests_c/bench_host" --small-only --out "$out/tables/bench_host_tp1.md"
old_vs_new 1 60 bench_overlap bench_comm_gemm

step_table >"$out/summary.md"
for f in "$out"/tables/*.md; do [ -f "$f" ] && { echo; echo "== ${f#$out/}"; cat "$f"; }; done
echo; grep -ahE "^(FAIL|\[rank [0-9]+\] FAIL)" "$out"/logs/*.log 2>/dev/null | head -n 20
echo; cat "$out/summary.md"
pack_results "$out"
exit $fail
