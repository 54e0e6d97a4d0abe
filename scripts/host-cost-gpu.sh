#!/usr/bin/env bash
# Host cost and FP8 accumulation of the C API on one GPU, in one call: builds tests_c against
# the library, then
#   - test_comm_gemm_fp8 (the comm-GEMM's FP8 accumulation against TE's reference) at 1, 2
#     and 4 ranks (2 and 4 sharing the GPU over IPC);
#   - bench_host at tp 1 (--strict: fails when a comm-GEMM / overlap call costs more than
#     10 us of host time or allocates) and with 2 ranks sharing the GPU;
#   - the regression tests of the C paths involved: test_gemm, test_comm_gemm, test_overlap,
#     test_graph at 1 rank;
#   - the comm-GEMM calls at tp 1 against torch.mm on the six GEMMs of the training step
#     (bench/comm_gemm_tp1_vs_torch.py: each within 1.02x of torch.mm's time; skipped
#     without torch with CUDA).
#
# Usage: scripts/host-cost-gpu.sh
#   -h, --help  this text (no options otherwise)
# Environment:
#   TE_COMM_LIB          the library (else target/release, built by cargo when present)
#   OUT                  output folder for logs and tables (default gpu-out/)
#   NVTE_COMM_CACHE_DIR  the kernel cache (default /tmp/te_comm_kernel_cache)
# Needs: one GPU (Hopper for the FP8 cases); the CUDA runtime, NCCL, MPI and CMake (tests_c);
# python3 with PyTorch (CUDA) for the torch.mm comparison; cargo only without TE_COMM_LIB.
# Takes: a few minutes (each step is limited to 120-240 s).
# Output: the tables and a summary table printed last; exit 1 on any failure.
set -uo pipefail
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}
lib=$(te_comm_library) || exit 1
build=$root/build-gpu
te_comm_cmake_build "$lib" "$build" -DTE_COMM_GPU_TESTS=ON 2>"$out/build.log" || { tail -n 40 "$out/build.log"; exit 1; }
fail=0
rows=()
step_logs=$out  # (common.sh's step: the logs beside the tables)
mpi=$root/tests_c/run_mpi.sh
for np in 1 2 4; do step "test_comm_gemm_fp8_np$np" 120 "$mpi" "$np" "$build/tests_c/test_comm_gemm_fp8"; done
step bench_host_tp1 120 "$mpi" 1 "$build/tests_c/bench_host" --strict --out "$out/bench_host_tp1.md"
step bench_host_tp2_shared 150 "$mpi" 2 "$build/tests_c/bench_host" --out "$out/bench_host_tp2_shared.md"
for t in test_gemm test_comm_gemm test_overlap test_graph; do step "${t}_np1" 180 "$mpi" 1 "$build/tests_c/$t"; done
if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  step tp1_vs_torch 240 python3 "$root/bench/comm_gemm_tp1_vs_torch.py" --lib "$lib" --out "$out/tp1_vs_torch.md"
else
  rows+=("| tp1_vs_torch | SKIPPED (no torch with CUDA) | - | 0 |")
fi
grep -hE "max \|fast - full" "$out"/test_comm_gemm_fp8_np*.log
grep -hE "FAIL" "$out"/*.log | head -n 20
[ -f "$out/tp1_vs_torch.md" ] && { echo; echo "comm-GEMM calls at tp 1 vs torch.mm (training-step GEMMs):"; cat "$out/tp1_vs_torch.md"; }
for f in "$out"/bench_host_*.md; do [ -f "$f" ] && { echo; echo "host cost per C call ($(basename "$f" .md)):"; cat "$f"; }; done
grep -hE "^host-cost bar|^tp [0-9]+: no bar|^\(nccl" "$out"/bench_host_*.log
echo
echo "| step | result | counts / bar | seconds |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $fail
