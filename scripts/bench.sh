#!/usr/bin/env bash
# The main job (README): the benchmark on all local GPUs, one MPI rank per GPU.
# For now: GEMM throughput through nvte_cublas_gemm (bf16 and FP8), TFLOP/s per GPU.
# Usage: scripts/bench.sh [NGPUS]   (TE_COMM_LIB=<path> to use a prebuilt library)
set -euo pipefail
source "$(dirname "$0")/common.sh"
n=${1:-$(gpu_count)}
[ "$n" -ge 1 ] || { echo "no GPU found (nvidia-smi -L lists none)" >&2; exit 1; }
lib=$(te_comm_library)
build=${TE_COMM_BUILD_DIR:-$root/build-gpu}
mkdir -p "$build"
te_comm_cmake_build "$lib" "$build"
"$root/tests_c/run_mpi.sh" "$n" "$build/tests_c/bench_gemm" "${@:2}"
