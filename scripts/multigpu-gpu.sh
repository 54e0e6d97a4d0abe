#!/usr/bin/env bash
# The multi-GPU check on a machine of 2, 4 or 8 GPUs, in parts that each fit the 10-minute limit
# of one device call (a time budget skips, and reports, what would not fit; on 4 H200s the
# C part alone took about 300 s):
#   c  the C/C++ GPU tests (scripts/gpu-test.sh's c stage) at 2 and 4 ranks.
#   a  bench_overlap and bench_comm_gemm (both transports) at 2 and 4; torch's async-TP
#      comparison (bench/torch_ops.py) at the largest count; the PyTorch example
#      (scripts/example-gpu.sh) at the largest count (bf16, FP8 delayed and current, each
#      with and without overlap, plus --num-replicas 2 on 4 GPUs) and the FP8 step's host
#      profile (--host-profile); the library at an older commit against HEAD
#      (bench_comm_gemm, same call, when .mg/old holds that tree's CMake files, tests_c and
#      its library); bench/acceptance.py and the plot. The default part.
#   r  a recheck of fixes made after a full run: the reliability tests at 2 and 4 ranks (one
#      GPU each; short soak and churn), test_comm_gemm at the largest count, and the bf16
#      and FP8 steps' host profiles at the largest count.
#   b  the reliability tests (fault injection, cross-rank check, soak, churn) at 2 and 4
#      ranks, processes and threads; the PyTorch package tests (scripts/torch-gpu.sh); the
#      JAX tests and example; the PyTorch example at 2 GPUs; torch_ops at 2;
#      compute-sanitizer memcheck.
#   f  block-scaled FP8 (Float8BlockScaling) on separate GPUs: the quantize kernel's A/B
#      bench first (test_block_quant, one GPU); test_comm_gemm_block at every rank count
#      (all-gather with the scales, B_copy, reduce-scatter, all-reduce, both C APIs, graph
#      replays); the torch modules at the largest count
#      (python/tests/torch/test_block_fp8_tp.py); the PyTorch example at the largest count
#      in bf16 and block FP8, with and without overlap; the JAX example's block MLP against
#      bf16 on every GPU (one process).
#
# Usage: scripts/multigpu-gpu.sh [c|a|r|b|f]   (default a)
#   -h, --help  this text
# Environment:
#   TE_COMM_LIB        the library (else target/release, built by cargo when present)
#   OUT                output folder (default gpu-out/)
#   TE_COMM_MG_BUDGET  seconds per part (default 560)
#   TE_COMM_MG_NPS     the rank counts, e.g. "8" or "2 4" (default: 2, and 4 with 4 GPUs or
#                      more; on 8 GPUs run each part again with TE_COMM_MG_NPS=8, since 2, 4
#                      and 8 together do not fit one part's budget). The largest count is
#                      the one the torch, example and recheck steps use.
# Needs: 2 or more GPUs (4 or 8 for those rank counts; Hopper for FP8); the CUDA runtime, NCCL, MPI
# and CMake (tests_c); PyTorch with CUDA (parts a, r, b, f), JAX with CUDA (parts b, f),
# compute-sanitizer (part b); cargo only without TE_COMM_LIB. Exit 77 (skipped) with fewer
# than 2 GPUs.
# Takes: up to TE_COMM_MG_BUDGET (560 s) per part, within one 10-minute device call.
# Output: everything under $OUT as one archive, results.tgz, beside summary.md; the summary
# table is printed last; exit 1 when a step failed.
set -uo pipefail
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
part=${1:-a}
case $part in
  a | b | c | r | f) ;;
  *) echo "multigpu-gpu.sh: unknown part '$part' (c, a, r, b or f; see --help)" >&2; exit 2 ;;
esac
out=${OUT:-$root/gpu-out}
mkdir -p "$out/logs"
budget=${TE_COMM_MG_BUDGET:-560}
t_start=$(date +%s)
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
ngpu=$(gpu_count)
[ "$ngpu" -ge 2 ] || { echo "multigpu-gpu: SKIPPED (needs 2 GPUs, found $ngpu)"; exit 77; }
if [ -n "${TE_COMM_MG_NPS:-}" ]; then
  read -r -a nps <<<"${TE_COMM_MG_NPS//,/ }"
  [ "${#nps[@]}" -gt 0 ] || { echo "multigpu-gpu: TE_COMM_MG_NPS names no rank count" >&2; exit 2; }
else
  nps=(2)
  [ "$ngpu" -ge 4 ] && nps+=(4)
fi
big=0
for np in "${nps[@]}"; do
  case $np in
    '' | *[!0-9]*) echo "multigpu-gpu: TE_COMM_MG_NPS: '$np' is not a rank count" >&2; exit 2 ;;
  esac
  [ "$np" -ge 2 ] && [ "$np" -le "$ngpu" ] || {
    echo "multigpu-gpu: TE_COMM_MG_NPS: $np ranks need 2 to $ngpu GPUs (found $ngpu)" >&2
    exit 2
  }
  [ "$np" -gt "$big" ] && big=$np
done
lib=$(te_comm_library) || exit 1
export TE_COMM_LIB=$lib PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH}
build=$root/build-gpu
echo "part $part; GPUs: $ngpu ($(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n1)); library $lib"
nvidia-smi topo -m >"$out/logs/topo.txt" 2>&1 || true

fail=0
rows=()
mpi=$root/tests_c/run_mpi.sh   # (a path, not a function: step runs it under timeout)

if [ "$part" = c ]; then
  step c "$budget" env OUT="$out/c" TE_COMM_STAGES=c "$root/scripts/gpu-test.sh" "${nps[@]}"
elif [ "$part" = a ]; then
  te_comm_cmake_build "$lib" "$build" -DTE_COMM_GPU_TESTS=ON || exit 1
  mkdir -p "$out/tables"
  for np in "${nps[@]}"; do
    step "bench_overlap_tp$np" 60 "$mpi" "$np" "$build/tests_c/bench_overlap" --out "$out/tables/bench_overlap_tp$np.md"
    step "bench_comm_gemm_tp$np" 80 "$mpi" "$np" "$build/tests_c/bench_comm_gemm" --out "$out/tables/bench_comm_gemm_tp$np.md"
  done
  step "torch_ops_tp$big" 120 python3 -m torch.distributed.run --standalone --nproc-per-node="$big" \
    "$root/bench/torch_ops.py" --out "$out/tables/torch_ops_tp$big.md"
  step "example_tp$big" 260 env OUT="$out" "$root/scripts/example-gpu.sh" --np "$big" --iters 20
  # Where an FP8 step's host time goes at the largest count (host-bound on 4 H200s,
  # 2026-11-26): cProfile over 5 steps, rank 0's top functions (logs/hostprofile_*.log).
  for ov in overlap no-overlap; do
    extra=()
    [ "$ov" = no-overlap ] && extra=(--no-comm-overlap)
    step "hostprofile_fp8_${ov}_tp$big" 90 python3 -m torch.distributed.run --standalone --nproc-per-node="$big" \
      "$root/examples/pytorch/layer_with_overlap.py" --fp8 --iters 8 --host-profile 5 "${extra[@]}"
  done
  # The older tree's bench_comm_gemm against HEAD's, anchor shapes, IPC and NCCL.
  old_vs_new "$big" 80 bench_comm_gemm
  tables=$(ls "$out"/tables/bench_*.md "$out"/tables/torch_ops_tp*.md 2>/dev/null)
  [ -n "$tables" ] && step acceptance 30 python3 "$root/bench/acceptance.py" $tables --out "$out/acceptance.md"
  [ -n "$tables" ] && step plot 30 python3 "$root/bench/plot.py" $tables --out "$out/tables/plot.png"
elif [ "$part" = r ]; then
  te_comm_cmake_build "$lib" "$build" -DTE_COMM_GPU_TESTS=ON || exit 1
  for np in "${nps[@]}"; do
    step "reliability_np$np" 120 "$build/tests_c/test_reliability" --ranks "$np" --soak-calls 1000 --churn-cycles 5
  done
  step "test_comm_gemm_np$big" 150 "$mpi" "$big" "$build/tests_c/test_comm_gemm"
  for ov in overlap no-overlap; do
    extra=()
    [ "$ov" = no-overlap ] && extra=(--no-comm-overlap)
    for fp in bf16 fp8; do
      f=()
      [ "$fp" = fp8 ] && f=(--fp8)
      step "hostprofile_${fp}_${ov}_tp$big" 60 python3 -m torch.distributed.run --standalone --nproc-per-node="$big" \
        "$root/examples/pytorch/layer_with_overlap.py" "${f[@]}" --iters 8 --host-profile 5 "${extra[@]}"
    done
  done
elif [ "$part" = f ]; then
  te_comm_cmake_build "$lib" "$build" -DTE_COMM_GPU_TESTS=ON || exit 1
  # The quantize A/B first (one GPU, ~30 s): the rows the budget must not drop.
  step test_block_quant 90 "$mpi" 1 "$build/tests_c/test_block_quant"
  for np in "${nps[@]}"; do
    step "test_comm_gemm_block_np$np" 90 "$mpi" "$np" "$build/tests_c/test_comm_gemm_block"
  done
  step "torch_block_tp$big" 150 python3 -m torch.distributed.run --standalone --nproc-per-node="$big" \
    -m pytest -q -rfEs -p no:cacheprovider "$root/python/tests/torch/test_block_fp8_tp.py"
  step "example_block_tp$big" 200 env OUT="$out" "$root/scripts/example-gpu.sh" --np "$big" --iters 20 --recipes none,block
  step jax_block_example 240 python3 "$root/examples/jax/mlp_with_overlap.py" --fp8-recipe block --compare-bf16 \
    --profile --profile-dir "$out/traces"
else
  te_comm_cmake_build "$lib" "$build" -DTE_COMM_GPU_TESTS=ON || exit 1
  for np in "${nps[@]}"; do
    step "reliability_np$np" 200 "$build/tests_c/test_reliability" --ranks "$np" --soak-calls 5000 --churn-cycles 20
    step "reliability_threads_np$np" 100 "$build/tests_c/test_reliability" --ranks "$np" --threads --soak-calls 5000 --churn-cycles 10
  done
  step torch_test 200 env OUT="$out" TE_COMM_TEST_TIMEOUT=190 "$root/scripts/torch-gpu.sh" "$big"
  jnps=$(IFS=,; echo "${nps[*]}")
  step jax_test 150 env TE_COMM_JAX_NP="$jnps" python3 -m pytest -q -rs -p no:cacheprovider "$root/python/tests/jax"
  step jax_example 90 python3 "$root/examples/jax/mlp_with_overlap.py" --steps 20
  [ "$big" -gt 2 ] && step example_tp2 150 env OUT="$out" "$root/scripts/example-gpu.sh" --np 2 --iters 20 --recipes none,delayed
  mkdir -p "$out/tables"
  step torch_ops_tp2 100 python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
    "$root/bench/torch_ops.py" --out "$out/tables/torch_ops_tp2.md"
  step sanitizer 120 env OUT="$out/san" TE_COMM_STAGES=sanitizer TE_COMM_SANITIZER_TOOLS=memcheck "$root/scripts/gpu-test.sh" 2
fi

step_table >"$out/summary.md"
for f in "$out"/c/summary.md "$out"/tables/*.md "$out"/example/summary.md "$out"/torch/summary.md "$out"/acceptance.md; do
  [ -f "$f" ] && { echo; echo "== ${f#$out/}"; cat "$f"; }
done
echo; grep -ahE "FAIL" "$out"/logs/*.log "$out"/c/*.log 2>/dev/null | head -n 20
echo; cat "$out/summary.md"
pack_results "$out"
exit $fail
