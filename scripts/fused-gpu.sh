#!/usr/bin/env bash
# The fused (atomic) algorithms on one GPU, in ONE device call (a time budget skips, and
# reports, what would not fit). By default, the library's fused-algorithm tests:
#   1. tests_c/test_fused with 1 rank (first: its NVRTC compile of kernels/gemm_sm90.cu
#      fills the kernel cache the shared runs then read), then 2 and 4 ranks sharing the GPU
#      (callback bootstrap, IPC): comm-GEMM AtomicP2P (all-gather, reduce-scatter,
#      all-reduce; our GEMM and its cuBLASLt fallbacks), the engine with atomic_gemm
#      (split_ag, split_rs_p2p, eager and CUDA-graph replays);
#   2. test_graph --only atomic_gemm at 1 rank (the fused all-gather and ring
#      reduce-scatter captured and replayed, both capture modes);
#   3. with NVTE_COMM_FUSED_TILES=narrow (the tuner's 128-wide tiles for the fused GEMM):
#      test_fused with 1 rank and 2 ranks sharing the GPU, and test_graph's atomic cases;
#   4. at 1 rank: test_comm_gemm (--quick: bf16; its AtomicP2P cases), test_overlap (its
#      fused_ag / split_rs_p2p fused cases among the rest, --iters 20), then test_api.
# With --all, first the own GEMM and the emulated link, then the above:
#   a. scripts/own-gemm-gpu.sh (base pass only): our GEMM kernel alone against cuBLASLt on
#      the anchor shapes, every feature kernel's correctness, flag costs, arrivals and done
#      signals;
#   b. scripts/emulated-link-gpu.sh --k-pieces with LINK_TUNED=1: the emulated-link overlap
#      benchmark (fused vs chunked vs the bound, flags only and real copies, tp 4 and 8; the
#      all-gather's pieces as K slices) and the autotuner's pick among the fused candidates
#      (bench/link_tuned.py);
#   c. the library's fused-algorithm tests above (in $OUT/fused, budget 320 s).
#
# Usage: scripts/fused-gpu.sh [--all]
#   --all       the own-GEMM check and the emulated-link benchmark first (see above)
#   -h, --help  this text
# Environment:
#   TE_COMM_LIB               the library (else target/release, built by cargo when present)
#   OUT                       output folder (default gpu-out/)
#   TE_COMM_FUSED_BUDGET      seconds for the library's tests (default 360)
#   TE_COMM_FUSED_ALL_BUDGET  seconds for everything with --all (default 570)
#   TE_COMM_FUSED_PARTS       the parts --all runs (default "kernel link lib": a, b, c above)
#   NVTE_COMM_CACHE_DIR       the kernel cache (default /tmp/te_comm_kernel_cache)
# Needs: one Hopper GPU (H100 / H200: our GEMM is sm_90a), the CUDA runtime, NCCL, MPI and
# CMake (tests_c); cargo only without TE_COMM_LIB. --all also the CUDA toolkit (headers,
# cudart, NVRTC, cuBLASLt) with g++ or nvcc, and python3.
# Takes: about 1-2 minutes on an H100 (at most TE_COMM_FUSED_BUDGET s); --all about 3-4
# minutes (at most TE_COMM_FUSED_ALL_BUDGET s, within one 10-minute device call).
# Output: logs in one archive, results.tgz, beside summary.md under $OUT; the summary is
# printed last; exit 1 when a step failed.
set -uo pipefail
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
all=0
for a in "$@"; do
  case $a in
    --all) all=1 ;;
    *) echo "fused-gpu.sh: unknown argument '$a' (see scripts/fused-gpu.sh --help)" >&2; exit 2 ;;
  esac
done
out=${OUT:-$root/gpu-out}
mkdir -p "$out/logs"
t_start=$(date +%s)
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}
fail=0
rows=()

# --all: the own GEMM and the emulated link, then this script again without --all (the
# library's tests, under the step's time limit) in $out/fused.
if [ "$all" = 1 ]; then
  budget=${TE_COMM_FUSED_ALL_BUDGET:-570}
  parts=" ${TE_COMM_FUSED_PARTS:-kernel link lib} "
  echo "GPUs: $(gpu_count) ($(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n1))"
  if [[ $parts == *" kernel "* ]]; then
    step own_gemm 240 env OUT="$out/own-gemm" OWN_GEMM_VARIANTS=base "$root/scripts/own-gemm-gpu.sh"
    rm -f "$out/own-gemm/own_gemm"
  fi
  if [[ $parts == *" link "* ]]; then
    step emulated_link 300 env OUT="$out/emulated-link" LINK_TUNED=1 "$root/scripts/emulated-link-gpu.sh" --k-pieces
    rm -f "$out/emulated-link/own_gemm_link"
  fi
  if [[ $parts == *" lib "* ]]; then
    step fused 330 env OUT="$out/fused" TE_COMM_FUSED_BUDGET=320 "$root/scripts/fused-gpu.sh"
  fi
  step_table >"$out/summary.md"
  f=$out/own-gemm/own_gemm_base.log
  [ -f "$f" ] && { echo; echo "== own GEMM"; sed -n '/^## own GEMM/,$p' "$f" | tail -n 45; }
  link=$out/emulated-link
  [ -f "$link/own_gemm_link.md" ] && { echo; echo "== emulated link"; tail -n 40 "$link/own_gemm_link.md"; }
  [ -f "$link/own_gemm_link_tuned.md" ] && { echo; echo "== emulated link, the autotuner's pick"; grep -E '^- ' "$link/own_gemm_link_tuned.md"; }
  [ -f "$link/own_gemm_link_sm_budget.md" ] && { echo; echo "== emulated link, copies on the SMs the GEMMs leave free"; grep -E '^- ' "$link/own_gemm_link_sm_budget.md"; }
  [ -f "$out/fused/summary.md" ] && { echo; echo "== fused algorithms"; cat "$out/fused/summary.md"; }
  echo; grep -ahE "^(FAIL|\[rank [0-9]+\] FAIL)|HANG" "$out"/logs/*.log 2>/dev/null | head -n 20
  echo; cat "$out/summary.md"
  pack_results "$out"
  exit $fail
fi

# The library's fused-algorithm tests.
budget=${TE_COMM_FUSED_BUDGET:-360}
lib=$(te_comm_library) || exit 1
build=$root/build-gpu
mpi=$root/tests_c/run_mpi.sh
te_comm_cmake_build "$lib" "$build" -DTE_COMM_GPU_TESTS=ON || exit 1
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
