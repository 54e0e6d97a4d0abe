#!/usr/bin/env bash
# The fused (atomic) algorithms on one GPU, in ONE device call (about 5 minutes; a time
# budget skips, and reports, what would not fit):
#   1. tests_c/test_fused with 1 rank (first: its NVRTC compile of kernels/gemm_sm90.cu
#      fills the kernel cache the shared runs then read), then 2 and 4 ranks sharing the GPU
#      (callback bootstrap, IPC):
#      comm-GEMM AtomicP2P (all-gather, reduce-scatter, all-reduce; our GEMM and its
#      cuBLASLt fallbacks), the engine with atomic_gemm (split_ag, split_rs_p2p, eager and
#      CUDA-graph replays);
#   2. at 1 rank: test_overlap (its fused_ag / split_rs_p2p fused cases among the rest,
#      --iters 20), test_comm_gemm (--quick: bf16; its AtomicP2P cases), test_graph
#      (--only atomic_gemm: the fused all-gather and ring reduce-scatter captured and
#      replayed, both capture modes), test_api;
#   (after test_graph: with NVTE_COMM_FUSED_TILES=narrow, the tuner's 128-wide tiles for
#   the fused GEMM, test_fused with 1 rank and 2 ranks sharing the GPU and test_graph's
#   atomic cases).
# Usage: scripts/fused-gpu.sh   (env TE_COMM_LIB, TE_COMM_FUSED_BUDGET seconds, default 360)
set -uo pipefail
source "$(dirname "$0")/common.sh"
out=${OUT:-$root/gpu-out}
mkdir -p "$out/logs"
budget=${TE_COMM_FUSED_BUDGET:-360}
t_start=$(date +%s)
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}
lib=$(te_comm_library) || exit 1
build=$root/build-gpu
mpi=$root/tests_c/run_mpi.sh
te_comm_cmake_build "$lib" "$build" -DTE_COMM_GPU_TESTS=ON || exit 1
fail=0
rows=()
step test_fused_np1 60 "$mpi" 1 "$build/tests_c/test_fused"
step test_fused_np2_shared 60 "$mpi" 2 "$build/tests_c/test_fused" --calls 5
step test_fused_np4_shared 75 "$mpi" 4 "$build/tests_c/test_fused" --calls 3
step test_graph_atomic_np1 45 "$mpi" 1 "$build/tests_c/test_graph" --only atomic_gemm --replays 20
step test_fused_np1_narrow 45 env NVTE_COMM_FUSED_TILES=narrow "$mpi" 1 "$build/tests_c/test_fused"
step test_fused_np2_shared_narrow 60 env NVTE_COMM_FUSED_TILES=narrow "$mpi" 2 "$build/tests_c/test_fused" --calls 5
step test_graph_atomic_np1_narrow 45 env NVTE_COMM_FUSED_TILES=narrow "$mpi" 1 "$build/tests_c/test_graph" --only atomic_gemm --replays 20
step test_comm_gemm_np1 60 "$mpi" 1 "$build/tests_c/test_comm_gemm" --quick
step test_overlap_np1 60 "$mpi" 1 "$build/tests_c/test_overlap" --iters 20
step test_api 20 "$build/tests_c/test_api"
step_table >"$out/summary.md"
echo; grep -ahE "^(FAIL|\[rank [0-9]+\] FAIL)" "$out"/logs/*.log 2>/dev/null | head -n 30
echo; grep -ahE "atomic|fused|Atomic" "$out"/logs/*.log 2>/dev/null | grep -E "PASS|FAIL" | head -n 60
echo; cat "$out/summary.md"
pack_results "$out"
exit $fail
