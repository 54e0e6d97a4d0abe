#!/usr/bin/env bash
# The whole GPU check in one command: builds tests_c against the library, runs every GPU
# test on 1, 2, 4 and 8 GPUs as available (or on the rank counts given), then the Python
# packages' GPU tests, the examples and the benchmarks. Stages (TE_COMM_STAGES, default all):
#   c            the C/C++ GPU tests (test_api, test_teardown, test_gemm, test_overlap,
#                test_comm_gemm, test_graph; test_comm_gemm_fp8 and test_comm_gemm_block,
#                with one GPU also at 2 and 4 ranks sharing it; test_block_quant and
#                test_block_gemm on one GPU)
#   reliability  fault injection, the cross-rank check, soak and churn (test_reliability),
#                processes and threads (with one GPU, threads only for the starved fused
#                all-gather: bounded calls, never a hang)
#   sanitizer    compute-sanitizer memcheck, racecheck and synccheck on test_comm_gemm,
#                test_overlap and test_block_quant (one GPU, --quick), each report
#                attributed to the library it came from
#   torch        scripts/torch-gpu.sh, scripts/torch-ext-gpu.sh, scripts/example-gpu.sh and
#                the quantization tests (when torch imports)
#   jax          the JAX package's GPU tests and its example (when jax imports)
#   bench        bench_gemm, bench_host, bench_overlap, bench_comm_gemm, torch_ops, jax_ops,
#                the plot, the performance bar (bench/acceptance.py), host cost, the
#                quantization bench and the GEMM against torch.matmul
#
# Usage: scripts/gpu-test.sh [NGPUS...]
#   NGPUS       rank counts to run (default: 1, 2, 4, 8 up to the GPUs present)
#   -h, --help  this text
# Environment:
#   TE_COMM_LIB                the library (else target/release, built by cargo when present)
#   OUT                        output folder (default gpu-out/)
#   TE_COMM_STAGES             the stages, e.g. "c torch bench" (default all six)
#   TE_COMM_TESTS              the MPI tests of the c stage (default test_gemm test_overlap
#                              test_comm_gemm test_graph)
#   TE_COMM_TEST_TIMEOUT       seconds per test run (default 300; longer for some stages)
#   TE_COMM_SHARED_SOAK_CALLS  soak calls with ranks sharing a GPU (default 2000)
#   TE_COMM_THREADS_SHARED=1   also threads sharing a GPU in one process (known to time out)
#   TE_COMM_SANITIZER_TOOLS    default "memcheck racecheck synccheck"
#   TE_COMM_SANITIZER_TIMEOUT  seconds per sanitizer run (default 420)
#   TE_COMM_BENCH_ARGS         extra bench_overlap options
# Needs: 1 or more GPUs (the multi-rank runs need as many, or share one); the CUDA runtime,
# NCCL, MPI and CMake (tests_c); compute-sanitizer for the sanitizer stage; PyTorch, JAX and
# matplotlib (each optional: its stages and rows are left out without it); cargo only
# without TE_COMM_LIB.
# Takes: the c stage about 5 minutes on 4 H200s; every stage together well over the
# 10-minute device-call limit (pick stages with TE_COMM_STAGES, or use multigpu-gpu.sh).
# Output: logs and a summary table in one archive, results.tgz, beside summary.md under $OUT;
# the table is printed last; exit non-zero on any failure.
set -uo pipefail
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
log=$out/tests.log
summary=$out/summary.md
: >"$log"
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}

ngpu=$(gpu_count)
if [ "$#" -gt 0 ]; then nps=("$@"); else nps=(); for n in 1 2 4 8; do [ "$n" -le "$ngpu" ] && nps+=("$n"); done; fi
echo "GPUs: $ngpu; rank counts: ${nps[*]}; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n1)" | tee -a "$log"
nvidia-smi topo -m >>"$log" 2>&1 || true

lib=$(te_comm_library) || exit 1
build=$root/build-gpu
mkdir -p "$build"
te_comm_cmake_build "$lib" "$build" -DTE_COMM_GPU_TESTS=ON 2>>"$log" || { echo "build failed (see $log)"; tail -n 40 "$log"; exit 1; }

fail=0
rows=()
run() {  # run NAME NP CMD...: log, time, and a summary row from the run's closing line
  local name=$1 np=$2; shift 2
  local t0=$(date +%s%N) rc one=$out/.run.log
  echo "=== $name np=$np: $*" >>"$log"
  timeout -k 10 "${TE_COMM_TEST_TIMEOUT:-300}" "$@" >"$one" 2>&1
  rc=$?
  cat "$one" >>"$log"
  local secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  # The closing line: "NAME: N passed, M failed", or the last "N passed ..." of a runner.
  local closing=$(grep -E "^$name: [0-9]+ passed" "$one" | tail -n 1 | sed "s/^$name: //")
  [ -n "$closing" ] || closing=$(grep -E "[0-9]+ passed" "$one" | tail -n 1 | sed -E 's/^[^0-9]*//; s/ =+$//')
  local result=PASS
  if [ $rc -eq 77 ]; then result=SKIPPED; elif [ $rc -eq 124 ]; then result="FAIL (wall timeout)"; fail=1; elif [ $rc -ne 0 ]; then result="FAIL (rc $rc)"; fail=1; fi
  rows+=("| $name | $np | $result | ${closing:--} | $secs |")
  rm -f "$one"
}

# Stages (TE_COMM_STAGES, default all): c = the C/C++ tests; reliability = fault
# injection, cross-rank check, soak, churn; sanitizer = compute-sanitizer memcheck,
# racecheck and synccheck on the GPU tests; torch = the PyTorch package
# tests, the C++ extension example and the PyTorch example's runs; jax = the JAX package's
# GPU tests (python/tests/jax) and its example; bench = the benchmarks.
stages=" ${TE_COMM_STAGES:-c reliability sanitizer torch jax bench} "
has_torch=0
python3 -c 'import torch' 2>/dev/null && has_torch=1
has_jax=0
python3 -c 'import jax' 2>/dev/null && has_jax=1
export TE_COMM_LIB=$lib PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH}

if [[ $stages == *" c "* ]]; then
  # Library-level API tests (no MPI), then the MPI GPU tests.
  run test_api 1 "$build/tests_c/test_api"
  run test_teardown 1 "$build/tests_c/test_teardown"
  for np in "${nps[@]}"; do
    for t in ${TE_COMM_TESTS:-test_gemm test_overlap test_comm_gemm test_graph}; do
      run "$t" "$np" "$root/tests_c/run_mpi.sh" "$np" "$build/tests_c/$t"
    done
  done
  # FP8 accumulation of the comm-GEMM API against TE's reference (contexts from MPI
  # callbacks over IPC): every rank count, and with one GPU also 2 and 4 ranks sharing it.
  fp8_nps=("${nps[@]}")
  [ "$ngpu" -lt 2 ] && fp8_nps+=(2 4)
  for np in "${fp8_nps[@]}"; do
    run test_comm_gemm_fp8 "$np" "$root/tests_c/run_mpi.sh" "$np" "$build/tests_c/test_comm_gemm_fp8"
  done
  # Block-scaled FP8: quantize / dequantize bit for bit and the GEMM entries (one GPU),
  # then the comm-GEMM and userbuffers calls with block inputs (B_copy included) at every
  # rank count, and with one GPU also 2 and 4 ranks sharing it.
  for t in test_block_quant test_block_gemm; do
    run "$t" 1 "$root/tests_c/run_mpi.sh" 1 "$build/tests_c/$t"
  done
  for np in "${fp8_nps[@]}"; do
    run test_comm_gemm_block "$np" "$root/tests_c/run_mpi.sh" "$np" "$build/tests_c/test_comm_gemm_block"
  done
fi

if [[ $stages == *" reliability "* ]]; then
  # Fault injection (a rank exits before / during a call), the cross-rank check, soak and
  # churn (tests_c/test_reliability.cpp). With one GPU, also 2 ranks sharing it (IPC only,
  # fewer soak calls: the ranks' kernels time-slice).
  rel_nps=("${nps[@]}")
  [ "$ngpu" -lt 2 ] && rel_nps+=(2 4)
  for np in "${rel_nps[@]}"; do
    extra=()
    [ "$np" -gt "$ngpu" ] && extra=(--soak-calls "${TE_COMM_SHARED_SOAK_CALLS:-2000}" --churn-cycles 20)
    TE_COMM_TEST_TIMEOUT=1500 run test_reliability "$np" "$build/tests_c/test_reliability" --ranks "$np" "${extra[@]}"
    # The same ranks as threads of one process, one GPU each: the in-process peer
    # transport (JAX's single-process multi-GPU case). Not with ranks sharing a GPU inside
    # one process: that configuration times out (bench/RESULTS.md, 2026-11-23), an open
    # problem (TE_COMM_THREADS_SHARED=1 runs it anyway).
    if [ "$np" -ge 2 ] && { [ "$np" -le "$ngpu" ] || [ "${TE_COMM_THREADS_SHARED:-0}" = 1 ]; }; then
      TE_COMM_TEST_TIMEOUT=900 run test_reliability "$np threads" "$build/tests_c/test_reliability" --ranks "$np" --threads "${extra[@]}"
    elif [ "$np" -eq 2 ]; then
      # Only the case that wants a shared GPU: the fused all-gather's GEMMs starving the
      # kernels that set their flags must end in bounded calls, never a hang.
      TE_COMM_TEST_TIMEOUT=300 run test_reliability "2 threads starve" "$build/tests_c/test_reliability" --ranks 2 --threads --only starve
    fi
  done
fi

if [[ $stages == *" sanitizer "* ]]; then
  # compute-sanitizer on the GPU tests at 2 ranks (1 with one GPU): each report is
  # attributed to the first host frame outside the CUDA runtime / driver (ours, NCCL,
  # cuBLASLt, the test) in the summary row; the raw reports are in the log.
  snp=2
  [ "$ngpu" -lt 2 ] && snp=1
  for tool in ${TE_COMM_SANITIZER_TOOLS:-memcheck racecheck synccheck}; do
    for t in test_comm_gemm test_overlap test_block_quant; do
      args=()
      tnp=$snp
      [ "$t" = test_overlap ] && args=(--iters 2)
      [ "$t" = test_comm_gemm ] && [ "$tool" = racecheck ] && args=(--quick)  # racecheck: bf16 only (cuBLASLt kernels are slow under it)
      # The block quantize kernels (shared-memory transposes): one GPU, every mode and
      # option, without the large cases and the bench.
      [ "$t" = test_block_quant ] && { args=(--no-bench --quick); tnp=1; }
      name="$tool:$t"
      one=$out/.san.log
      t0=$(date +%s%N)
      TE_COMM_SANITIZER=$tool timeout -k 10 "${TE_COMM_SANITIZER_TIMEOUT:-420}" \
        "$root/tests_c/run_mpi.sh" "$tnp" "$build/tests_c/$t" "${args[@]}" >"$one" 2>&1
      rc=$?
      echo "=== $name np=$tnp (rc $rc)" >>"$log"
      cat "$one" >>"$log"
      secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
      errs=$(grep -Eo 'ERROR SUMMARY: [0-9]+' "$one" | awk '{ s += $3 } END { print s + 0 }')
      # Attribution: per report, the first host frame not in libcuda / libcudart.
      who=$(awk '/^========= [A-Z]/ && !/Host Frame|ERROR SUMMARY|COMPUTE-SANITIZER/ { want = 1; next }
                 want && /Host Frame/ && !/libcuda\.so|libcudart/ {
                   o = $0; sub(/.*in /, "", o); sub(/ .*/, "", o); n = split(o, p, "/"); c[p[n]]++; want = 0 }
                 END { for (k in c) printf "%s%s: %d", (s++ ? ", " : ""), k, c[k] }' "$one")
      closing=$(grep -E "[0-9]+ passed" "$one" | tail -n 1 | sed -E 's/^[^0-9]*//; s/ =+$//')
      result=PASS
      if [ "$rc" -eq 124 ]; then result="FAIL (wall timeout)"; fail=1
      elif [[ $closing =~ (^|[^0-9])[1-9][0-9]*\ failed ]]; then result="FAIL (checks failed)"; fail=1
      elif [ -z "$closing" ] && [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ]; then result="FAIL (no summary, rc $rc)"; fail=1
      elif [[ $who == *libtransformer_engine_comm* ]]; then result="FAIL (reports from the library)"; fail=1
      elif [ "$errs" -gt 0 ]; then result="REPORTS ($errs, none from the library)";
      elif [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ]; then result="FAIL (rc $rc)"; fail=1; fi
      rows+=("| $name | $tnp | $result | ${closing:--}; sanitizer errors: $errs${who:+ ($who)} | $secs |")
      rm -f "$one"
    done
  done
fi

if [[ $stages == *" torch "* ]] && [ "$has_torch" = 1 ]; then
  TE_COMM_TEST_TIMEOUT=1200 run torch-gpu "2,4" "$root/scripts/torch-gpu.sh"
  run torch_extension "2,4" "$root/scripts/torch-ext-gpu.sh"
  TE_COMM_TEST_TIMEOUT=900 run example-gpu "2,4" "$root/scripts/example-gpu.sh"
  run quantize-test 1 python3 -m pytest -q -rs -p no:cacheprovider "$root/python/tests/test_quantize.py"
fi

if [[ $stages == *" jax "* ]] && [ "$has_jax" = 1 ]; then
  # Process counts: the rank counts above; with one GPU, 2 processes share it.
  jnps=$(IFS=,; echo "${nps[*]}")
  [ "$ngpu" -eq 1 ] && jnps="1,2"
  TE_COMM_JAX_NP=$jnps TE_COMM_TEST_TIMEOUT=1800 run jax-test "$jnps" \
    python3 -m pytest -q -rs -p no:cacheprovider "$root/python/tests/jax"
  TE_COMM_TEST_TIMEOUT=600 run jax-example "$ngpu" python3 "$root/examples/jax/mlp_with_overlap.py" --steps 20
fi

if [[ $stages == *" bench "* ]]; then
  # Benchmark on all GPUs, then the comparison with torch.matmul in one process.
  run bench_gemm "$ngpu" "$root/tests_c/run_mpi.sh" "$ngpu" "$build/tests_c/bench_gemm" --out "$out/bench_gemm.md"
  # Host cost of a C call: tp 1 (the 10 us bar, --strict) and 2 ranks sharing GPU 0.
  run bench_host 1 "$root/tests_c/run_mpi.sh" 1 "$build/tests_c/bench_host" --strict --out "$out/bench_host_tp1.md"
  CUDA_VISIBLE_DEVICES=0 run bench_host "2 shared" "$root/tests_c/run_mpi.sh" 2 "$build/tests_c/bench_host" --out "$out/bench_host_tp2_shared.md"
  for np in "${nps[@]}"; do
    [ "$np" -ge 2 ] || continue
    run bench_overlap "$np" "$root/tests_c/run_mpi.sh" "$np" "$build/tests_c/bench_overlap" --out "$out/bench_overlap_tp$np.md" ${TE_COMM_BENCH_ARGS:-}
    run bench_comm_gemm "$np" "$root/tests_c/run_mpi.sh" "$np" "$build/tests_c/bench_comm_gemm" --out "$out/bench_comm_gemm_tp$np.md"
    [ "$has_torch" = 1 ] && run torch_ops "$np" python3 -m torch.distributed.run --standalone --nproc-per-node="$np" \
      "$root/bench/torch_ops.py" --out "$out/torch_ops_tp$np.md"
  done
  [ "$has_jax" = 1 ] && TE_COMM_TEST_TIMEOUT=900 run jax_ops "$ngpu" python3 "$root/bench/jax_ops.py" --out "$out/jax_ops.md"
  # One PNG of every table: ours and the baseline over the bound, per shape.
  tables=$(ls "$out"/bench_overlap_tp*.md "$out"/bench_comm_gemm_tp*.md "$out"/torch_ops_tp*.md "$out"/jax_ops.md 2>/dev/null)
  [ -n "$tables" ] && python3 -c 'import matplotlib' 2>/dev/null && \
    run plot 1 python3 "$root/bench/plot.py" $tables --out "$out/plot.png"
  # The performance bar per benchmark, tp, dtype and op (geomean and worst ours/bound).
  [ -n "$tables" ] && run acceptance 1 python3 "$root/bench/acceptance.py" $tables --out "$out/acceptance.md"
  # Host µs per torch op call at tp 1 (PASS/FAIL against 40 µs at 256³).
  [ "$has_torch" = 1 ] && run host_cost 1 python3 "$root/bench/host_cost.py" --out "$out/host_cost.md"
  [ "$has_torch" = 1 ] && run quantize_bench 1 python3 "$root/bench/quantize_bench.py" --out "$out/quantize_bench.md"
  [ "$has_torch" = 1 ] && run gemm_vs_torch 1 python3 "$root/bench/gemm_vs_torch.py" --lib "$lib" --out "$out/gemm_vs_torch.md"
fi

{
  echo "| test | ranks | result | counts | seconds |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} >"$summary"
[ -f "$out/bench_gemm.md" ] && { echo; echo "GEMM benchmark:"; cat "$out/bench_gemm.md"; }
for f in "$out"/bench_host_*.md; do [ -f "$f" ] && { echo; echo "host cost per C call ($(basename "$f" .md)):"; cat "$f"; }; done
[ -f "$out/gemm_vs_torch.md" ] && { echo; echo "nvte_cublas_gemm vs torch:"; cat "$out/gemm_vs_torch.md"; }
[ -f "$out/quantize_bench.md" ] && { echo; echo "quantization kernels (bench/quantize_bench.py):"; cat "$out/quantize_bench.md"; }
for f in "$out"/bench_overlap_tp*.md "$out"/bench_comm_gemm_tp*.md "$out"/torch_ops_tp*.md "$out"/jax_ops.md; do [ -f "$f" ] && { echo; echo "benchmark ($(basename "$f" .md)):"; cat "$f"; }; done
[ -f "$out/example/summary.md" ] && { echo; echo "layer_with_overlap.py (scripts/example-gpu.sh):"; cat "$out/example/summary.md"; }
[ -f "$out/acceptance.md" ] && { echo; echo "performance bar (bench/acceptance.py):"; cat "$out/acceptance.md"; }
echo; grep -E "FAIL" "$log" | head -n 30
echo; cat "$summary"
# At most 8 files come back from the device machine: everything in one archive beside
# the summary (tar -xzf results.tgz to read the logs and tables).
pack_results "$out"
exit $fail
