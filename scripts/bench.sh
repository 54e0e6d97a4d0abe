#!/usr/bin/env bash
# The main job (README): the overlap benchmark on all local GPUs, one MPI rank per GPU,
# all ranks one tensor-parallel group. Per anchor shape and algorithm: GEMM alone, NCCL
# alone, NCCL then GEMM, ours, ours / max(GEMM, NCCL).
# Usage: scripts/bench.sh [NGPUS] [bench_overlap args, e.g. --only ag --iters 20 --out FILE]
# (TE_COMM_LIB=<path> uses a prebuilt library; else cargo builds one.)
set -euo pipefail
source "$(dirname "$0")/common.sh"
n=${1:-$(gpu_count)}
[ "$n" -ge 1 ] || { echo "no GPU found (nvidia-smi -L lists none)" >&2; exit 1; }
lib=$(te_comm_library)
build=${TE_COMM_BUILD_DIR:-$root/build-gpu}
mkdir -p "$build"
te_comm_cmake_build "$lib" "$build"
"$root/tests_c/run_mpi.sh" "$n" "$build/tests_c/bench_overlap" "${@:2}"
