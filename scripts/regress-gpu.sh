#!/usr/bin/env bash
# One-GPU regression of a change that has not run on a GPU yet, in ONE device call of at
# most 10 minutes (a time budget skips, and reports, what would not fit):
#   1. the C/C++ GPU tests at 1 rank (test_api, test_teardown, test_gemm, test_overlap,
#      test_comm_gemm, test_graph) and the FP8 accumulation test with 1, 2 and 4 ranks
#      (2 and 4 sharing the GPU over IPC);
#   2. the reliability cases with 2 and 4 ranks sharing the GPU (IPC: the overlap API and
#      the comm-GEMM API with callback contexts): fault, mismatch, unchecked, and a short
#      soak and churn;
#   3. JAX at tp 1 (when jax imports): the ops, gradients and training with command
#      buffers off and on, and shard_map in one process (TE_COMM_JAX_NP=1,2 adds the
#      two-process runs sharing the GPU, which need more than this call's budget);
#   4. torch at tp 1 (when torch imports): the ops (every layout, prepared calls, graphs),
#      the modules and the userbuffers API on a one-rank group;
#   5. block-scaled FP8 at tp 1: quantize / dequantize bit for bit (test_block_quant), the
#      GEMM entries against fp64 (test_block_gemm), the torch modules and JAX's layers;
#      the comm-GEMM API with block-scaled inputs (test_comm_gemm_block, eager and CUDA
#      graph replays) with 1, 2 and 4 ranks sharing the GPU;
#   6. old against new at tp 1, same card, same call: bench_overlap and bench_comm_gemm
#      with the library and tests_c of an older tree in .mg/old (libtransformer_engine_comm.so
#      beside its CMakeLists.txt, cmake/, include/, tests_c/, scripts/common.sh), when there;
#   7. host cost per C call (bench_host: us and allocations per call, tp 1).
#
# Usage: TE_COMM_LIB=<libtransformer_engine_comm.so> scripts/regress-gpu.sh
#   -h, --help  this text (no options otherwise)
# Environment:
#   TE_COMM_LIB             the library (else target/release, built by cargo when present)
#   OUT                     output folder (default gpu-out/)
#   TE_COMM_REGRESS_BUDGET  seconds for everything (default 560)
#   TE_COMM_JAX_NP          the JAX tests' process counts (default 1)
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
pypath="$root/python${PYTHONPATH:+:$PYTHONPATH}"
# JAX at tp 1 (more processes share the GPU in process-local mode, the library's IPC).
jax_np=${TE_COMM_JAX_NP:-1}
if python3 -c 'import jax' 2>/dev/null; then
  jax_k="test_ops_grads_training or test_shard_map"
  [ "$jax_np" = 1 ] && jax_k="test_ops_grads_training or test_shard_map_single_process"
  step "jax_np${jax_np//,/_}" 150 env PYTHONPATH="$pypath" TE_COMM_JAX_NP="$jax_np" TE_COMM_JAX_SHARED=1 \
    python3 -m pytest -q -rs -p no:cacheprovider -k "$jax_k" "$root/python/tests/jax"
fi
# torch at tp 1: the ops under a one-rank torchrun, the modules and userbuffers standalone.
if python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  step torch_ops_tp1 150 env PYTHONPATH="$pypath" TE_COMM_TORCH_TP1=1 TE_COMM_SKIP_INDUCTOR=1 \
    python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
    -m pytest -q -rfEs -p no:cacheprovider "$root/python/tests/torch/test_ops.py"
  step torch_modules_tp1 150 env PYTHONPATH="$pypath" python3 -m pytest -q -rfEs -p no:cacheprovider \
    "$root/python/tests/torch/test_modules_tp1.py" "$root/python/tests/torch/test_userbuffers_tp1.py"
fi
# Block-scaled FP8 at tp 1: quantize / dequantize bit for bit, the GEMM entries against an
# fp64 reference, the torch modules against their emulation, JAX's block layers.
for t in test_block_quant test_block_gemm; do
  [ -x "$build/tests_c/$t" ] && step "${t}_np1" 120 "$mpi" 1 "$build/tests_c/$t"
done
# The comm-GEMM API with block-scaled inputs: GEMM + RS / AR at 1, 2 and 4 ranks sharing
# the GPU, the all-gather GEMM at 1 (refused with its reason at more), graph replays.
if [ -x "$build/tests_c/test_comm_gemm_block" ]; then
  for np in 1 2 4; do step "test_comm_gemm_block_np$np" 90 "$mpi" "$np" "$build/tests_c/test_comm_gemm_block"; done
fi
if python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null \
  && [ -f "$root/python/tests/torch/test_block_fp8.py" ]; then
  step torch_block_fp8_tp1 120 env PYTHONPATH="$pypath" python3 -m pytest -q -rfEs -p no:cacheprovider \
    "$root/python/tests/torch/test_block_fp8.py"
fi
if python3 -c 'import jax' 2>/dev/null && [ -f "$root/python/tests/jax/test_jax_block_fp8_gpu.py" ]; then
  step jax_block_fp8_tp1 120 env PYTHONPATH="$pypath" XLA_PYTHON_CLIENT_PREALLOCATE=false \
    python3 -m pytest -q -rfEs -p no:cacheprovider "$root/python/tests/jax/test_jax_block_fp8_gpu.py"
fi
old_vs_new 1 60 bench_overlap bench_comm_gemm
step bench_host_tp1 60 "$mpi" 1 "$build/tests_c/bench_host" --small-only --out "$out/tables/bench_host_tp1.md"

step_table >"$out/summary.md"
for f in "$out"/tables/*.md; do [ -f "$f" ] && { echo; echo "== ${f#$out/}"; cat "$f"; }; done
echo; grep -ahE "^(FAIL|\[rank [0-9]+\] FAIL)" "$out"/logs/*.log 2>/dev/null | head -n 20
echo; cat "$out/summary.md"
pack_results "$out"
exit $fail
