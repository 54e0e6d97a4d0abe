#!/usr/bin/env bash
# Issue 22 (our own atomic GEMM) on one GPU, in one device call of at most 10 minutes
# (a time budget skips, and reports, what would not fit):
#   1. scripts/own-gemm-gpu.sh: the kernel alone against cuBLASLt on the anchors, every
#      feature kernel's correctness, flag costs, arrivals and done signals;
#   2. scripts/own-gemm-link-gpu.sh --k-pieces with LINK_TUNED=1: the emulated-link overlap
#      benchmark (fused vs chunked vs the bound, flags only and real copies, tp 4 and 8;
#      the all-gather's pieces as K slices, NVTE_COMM_AG_PIECES=k), and the autotuner's
#      pick among the fused candidates (bench/link_tuned.py);
#   3. the library's fused algorithms (scripts/fused-gpu.sh): test_fused at 1 rank and 2 / 4
#      ranks sharing the GPU over IPC, the atomic cases of test_graph, test_comm_gemm and
#      test_overlap at 1 rank, and with 128-wide tiles (NVTE_COMM_FUSED_TILES=narrow).
# Usage: TE_COMM_LIB=<libtransformer_engine_comm.so> scripts/issue22-gpu.sh
#   env TE_COMM_I22_BUDGET: seconds (default 570); TE_COMM_I22_PARTS (default "kernel link lib").
# Everything under $OUT (or gpu-out/) as results.tgz beside summary.md; summary last.
set -uo pipefail
source "$(dirname "$0")/common.sh"
out=${OUT:-$root/gpu-out}
mkdir -p "$out/logs"
budget=${TE_COMM_I22_BUDGET:-570}
t_start=$(date +%s)
parts=" ${TE_COMM_I22_PARTS:-kernel link lib} "
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}
fail=0
rows=()
echo "GPUs: $(gpu_count) ($(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n1))"
if [[ $parts == *" kernel "* ]]; then
  step own_gemm 240 env OUT="$out/own-gemm" OWN_GEMM_VARIANTS=base "$root/scripts/own-gemm-gpu.sh"
  rm -f "$out/own-gemm/own_gemm"
fi
if [[ $parts == *" link "* ]]; then
  step own_gemm_link 300 env OUT="$out/own-gemm-link" LINK_TUNED=1 "$root/scripts/own-gemm-link-gpu.sh" --k-pieces
  rm -f "$out/own-gemm-link/own_gemm_link"
fi
if [[ $parts == *" lib "* ]]; then
  # (scripts/fused-gpu.sh: test_fused at 1 rank and 2 / 4 ranks sharing the GPU, the atomic
  # cases of test_graph, test_comm_gemm, test_overlap at 1 rank, test_api)
  step fused 330 env OUT="$out/fused" TE_COMM_FUSED_BUDGET=320 "$root/scripts/fused-gpu.sh"
fi
step_table >"$out/summary.md"
for f in "$out"/own-gemm/own_gemm_base.log; do
  [ -f "$f" ] && { echo; echo "== own GEMM"; sed -n '/^## own GEMM/,$p' "$f" | tail -n 45; }
done
[ -f "$out/own-gemm-link/own_gemm_link.md" ] && { echo; echo "== emulated link"; tail -n 40 "$out/own-gemm-link/own_gemm_link.md"; }
[ -f "$out/own-gemm-link/own_gemm_link_tuned.md" ] && { echo; echo "== emulated link, the autotuner's pick"; grep -E '^- ' "$out/own-gemm-link/own_gemm_link_tuned.md"; }
[ -f "$out/own-gemm-link/own_gemm_link_sm_budget.md" ] && { echo; echo "== emulated link, copies on the SMs the GEMMs leave free"; grep -E '^- ' "$out/own-gemm-link/own_gemm_link_sm_budget.md"; }
[ -f "$out/fused/summary.md" ] && { echo; echo "== fused algorithms"; cat "$out/fused/summary.md"; }
echo; grep -ahE "^(FAIL|\[rank [0-9]+\] FAIL)|HANG" "$out"/logs/*.log 2>/dev/null | head -n 20
echo; cat "$out/summary.md"
pack_results "$out"
exit $fail
