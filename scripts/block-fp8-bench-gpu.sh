#!/usr/bin/env bash
# Block-scaled FP8 (Float8BlockScaling) measured on one GPU, from the repository root
# (PYTHONPATH=python is set here): bench/block_fp8_bench.py
#   1. the anchor GEMMs (tokens x K x N: 8192x8192x3584, 8192x4096x2048, 16384x8192x1024):
#      bf16, per-tensor FP8 (torch._scaled_mm) and block-scaled FP8 through the torch path
#      (the library's nvte_cublas_gemm, 1D x and 2D W), CUDA events, warm-up, median; their
#      errors against fp32, and the block casts' time;
#   2. examples/pytorch/layer_with_overlap.py at tp 1 (one process, default size) in bf16,
#      FP8 current scaling and FP8 block scaling, eager and --cuda-graph: step time and
#      final loss, and the bar "block's final loss within 2 % of bf16's".
#
# Usage: scripts/block-fp8-bench-gpu.sh [--iters N] [--warmup N] [--skip-step] [--skip-gemm]
#   --iters N     timed steps per example row (default 30)
#   --warmup N    warm-up steps per example row (default 5)
#   --skip-step   only the GEMMs;  --skip-gemm: only the example's steps
#   -h, --help    this text
# Environment:
#   TE_COMM_LIB           the library (else target/release, built by cargo when present)
#   OUT                   output folder (default gpu-out/); everything goes to $OUT/block-fp8
#   PYTHON                the interpreter (default python3)
#   CUDA_VISIBLE_DEVICES  the GPU (default 0)
# Needs: one Hopper GPU (H100 / H200); PyTorch with CUDA; a library with block-scaled
# tensors and GEMMs (older builds: the block GEMM column says so and is not timed).
# Takes: about 4 minutes (six example runs of the default size, three GEMM shapes).
# Output: logs and summary.md under $OUT/block-fp8, the table printed last; exit non-zero
# when a run fails (a missed loss bar is reported, not an error).
set -uo pipefail
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
out=${OUT:-$root/gpu-out}/block-fp8
mkdir -p "$out"
lib=$(te_comm_library) || exit 1
export TE_COMM_LIB=$lib
export PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}
py=${PYTHON:-python3}
"$py" "$root/bench/block_fp8_bench.py" --out "$out" "$@"
