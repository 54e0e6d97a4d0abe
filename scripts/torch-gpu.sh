#!/usr/bin/env bash
# The PyTorch integration tests on GPUs: every test file in python/tests/torch (the ops,
# the userbuffers API, the modules, the optimizer, the GEMM, the example), one pytest per
# rank under torchrun, on 2 GPUs and on 4 when present (or on the rank counts given).
#
# Usage: scripts/torch-gpu.sh [NGPUS...]
#   NGPUS       rank counts to run (default: 2, and 4 when 4 GPUs are present)
#   -h, --help  this text
# Environment:
#   TE_COMM_LIB             the library (else target/release, built by cargo when present)
#   OUT                     output folder (default gpu-out/); everything goes to $OUT/torch
#   PYTHON                  the interpreter (default python3)
#   TE_COMM_TEST_TIMEOUT    seconds per rank count (default 540)
#   PYTEST_ADDOPTS          extra pytest options, e.g. "-k ops -x"
#   TE_COMM_SKIP_INDUCTOR=1 no torch.compile inductor compile
#   NVTE_COMM_TIMEOUT_MS    a peer's arrival timeout (default here 30000)
# Needs: 2 or more GPUs (4 for the 4-rank run); PyTorch with CUDA and NCCL, pytest; cargo
# only without TE_COMM_LIB. Exit 77 (skipped) with fewer than 2 GPUs.
# Takes: about 2-4 minutes per rank count (at most TE_COMM_TEST_TIMEOUT s each).
# Output: rank 0's pytest output is the run's log $OUT/torch/np<N>.log, the other ranks' are
# $OUT/torch/np<N>/rank<R>.log; one summary line per rank count and a table last
# ($OUT/torch/summary.md); exit non-zero when any rank of any run fails.
set -uo pipefail
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
out=${OUT:-$root/gpu-out}/torch
mkdir -p "$out"
log=$out/torch-gpu.log
: >"$log"
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}
# A peer that never arrives fails the call after 30 s instead of the default 60 s.
export NVTE_COMM_TIMEOUT_MS=${NVTE_COMM_TIMEOUT_MS:-30000}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
py=${PYTHON:-python3}

ngpu=$(gpu_count)
if [ "$#" -gt 0 ]; then nps=("$@"); else nps=(); for n in 2 4; do [ "$n" -le "$ngpu" ] && nps+=("$n"); done; fi
echo "GPUs: $ngpu; rank counts: ${nps[*]:-none}; $("$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))' 2>&1 | tail -n 1)" | tee -a "$log"
if [ "${#nps[@]}" -eq 0 ]; then echo "torch-gpu: SKIPPED (needs 2 GPUs, found $ngpu)" | tee -a "$log"; exit 77; fi

lib=$(te_comm_library) || exit 1
export TE_COMM_LIB=$lib
export PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH}
echo "library: $lib" | tee -a "$log"

fail=0
rows=()
tot_pass=0 tot_fail=0 tot_skip=0
for np in "${nps[@]}"; do
  rlog=$out/np$np.log
  rdir=$out/np$np
  mkdir -p "$rdir"
  rm -f "$rdir"/rank*.log
  tlogs=$(mktemp -d /tmp/te_comm_torchrun_np$np.XXXXXX)
  # Rank 0 prints to the console (this run's log); ranks 1.. write to files (torchrun
  # --redirects), copied to $rdir/rank<R>.log afterwards.
  redirects=$(seq -s, 1 $((np - 1)) | sed -E 's/([0-9]+)/\1:3/g')
  echo "=== pytest python/tests/torch under torchrun np=$np (rank 0: $rlog; other ranks: $rdir/)" | tee -a "$log"
  t0=$(date +%s)
  # Each run its own inductor cache (the ranks of one run share it).
  (cd "$root" && TE_COMM_TORCH_LOG_DIR=$rdir TORCHINDUCTOR_CACHE_DIR=/tmp/te_comm_inductor_np$np \
    timeout -k 20 "${TE_COMM_TEST_TIMEOUT:-540}" "$py" -m torch.distributed.run --standalone --nproc-per-node="$np" \
    --log-dir "$tlogs" --redirects "$redirects" \
    -m pytest -q -rfEsx -p no:cacheprovider python/tests/torch) >"$rlog" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  for r in $(seq 1 $((np - 1))); do
    for f in $(find "$tlogs" -path "*/attempt_*/$r/stdout.log" -o -path "*/attempt_*/$r/stderr.log" | sort -r); do
      cat "$f" >>"$rdir/rank$r.log"
    done
  done
  rm -rf "$tlogs"
  # pytest's closing line, e.g. "120 passed, 4 skipped in 98.12s" (with or without ===).
  closing=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed).* in [0-9.]+s' "$rlog" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
  outcome=$(grep -E '^te_comm torch tests: ' "$rlog" | tail -n 1)
  result=PASS
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then result="FAIL (wall timeout ${TE_COMM_TEST_TIMEOUT:-540}s)"; fail=1
  elif [ $rc -ne 0 ]; then result="FAIL (rc $rc)"; fail=1
  elif [ -z "$closing" ]; then result="FAIL (no pytest summary)"; fail=1
  elif ! echo "$closing" | grep -qE '[0-9]+ passed'; then result="FAIL (nothing passed)"; fail=1
  fi
  if [ "$result" != PASS ]; then
    {
      echo "--- np=$np: failures (rank 0)"
      grep -E '^(FAILED|ERROR) ' "$rlog" | head -n 40
      for f in "$rdir"/rank*.log; do
        [ -f "$f" ] || continue
        if grep -qE '^(FAILED|ERROR) |Traceback|Error' "$f"; then
          echo "--- $(basename "$f") (tail)"
          tail -n 15 "$f"
        fi
      done
      echo "--- torchrun (tail of $rlog)"
      tail -n 25 "$rlog"
    } | tee -a "$log"
  fi
  count() { echo "$closing" | grep -oE "[0-9]+ $1" | head -n 1 | cut -d' ' -f1; }
  p=$(count passed); f=$(count failed); e=$(count 'errors?'); s=$(count skipped)
  tot_pass=$((tot_pass + ${p:-0})); tot_skip=$((tot_skip + ${s:-0}))
  nf=$(( ${f:-0} + ${e:-0} )); [ "$result" != PASS ] && [ "$nf" -eq 0 ] && nf=1
  tot_fail=$((tot_fail + nf))
  line="torch-gpu np=$np: $result${closing:+ | $closing}${outcome:+ | ${outcome#te_comm torch tests: }} | ${secs}s"
  echo "$line" | tee -a "$log"
  rows+=("| torch ops/userbuffers (python/tests/torch) | $np | $result | ${closing:--} | $secs |")
done

{
  echo "| test | ranks | result | counts | seconds |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$out/summary.md"
# Closing line (counts summed over the rank counts; a run that failed without a pytest
# summary counts as one failure).
echo "torch-gpu: $tot_pass passed, $tot_fail failed, $tot_skip skipped (rank counts ${nps[*]})"
exit $fail
