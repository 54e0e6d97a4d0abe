#!/usr/bin/env bash
# The torch ops' layouts (transa / transb) and host cost on ONE GPU, from a prebuilt
# library (no cargo), in one call. Stages:
#   1. c_test_api: the C contract test of the header, built with cc (no GPU needed);
#   2. ops_meta_cpu: the CPU shape tests of the ops (meta / fake tensors) and the C API's
#      Python tests;
#   3. ops_gpu_tp1: the torch GPU tests of the ops at tp 1 (torchrun, 1 rank: every layout
#      against torch in fp32, the prepared-call path, CUDA graphs, torch.compile with
#      aot_eager);
#   4. host_cost: bench/host_cost.py (host us per call; PASS/FAIL against 40 us).
#
# Usage: TE_COMM_LIB=/path/libtransformer_engine_comm.so scripts/torch-ops-gpu.sh
#   -h, --help  this text (no options otherwise)
# Environment:
#   TE_COMM_LIB              the prebuilt library (required)
#   OUT                      output folder for the logs (default torch-ops-out/)
#   PYTHON                   the interpreter (default python3)
#   PYTHONPATH               default python/
#   TE_COMM_SKIP_INDUCTOR    default 1 (inductor's first compile alone takes minutes)
# Needs: one GPU; PyTorch with CUDA, pytest; a C compiler (cc, gcc or clang) for stage 1.
# Takes: about 2-4 minutes (stages limited to 60, 60, 150 and 90 s).
# Output: logs under $OUT, a table last; exit status 1 when a stage failed.
set -u
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
cd "$root"
out=${OUT:-$root/torch-ops-out}
mkdir -p "$out"
: "${TE_COMM_LIB:?set TE_COMM_LIB to the prebuilt libtransformer_engine_comm.so}"
export PYTHONPATH=${PYTHONPATH:-$root/python}
export TE_COMM_SKIP_INDUCTOR=${TE_COMM_SKIP_INDUCTOR:-1}  # inductor's first compile alone takes minutes
py=${PYTHON:-python3}
names=() results=() secs=()
fail=0

stage() {
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  echo "=== $name: $*"
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  names+=("$name")
  secs+=($(( $(date +%s) - t0 )))
  if [ $rc -eq 0 ]; then
    results+=("PASS")
  else
    results+=("FAIL (rc $rc)")
    fail=1
    tail -n 40 "$out/$name.log"
  fi
  tail -n 3 "$out/$name.log"
}

cc=$(command -v cc || command -v gcc || command -v clang || true)
if [ -n "$cc" ]; then
  stage c_test_api 60 bash -c "'$cc' -std=c99 -Wall -Wextra -Werror -I include tests_c/test_api.c '$TE_COMM_LIB' \
    -Wl,-rpath,'$(dirname "$TE_COMM_LIB")' -o '$out/test_api' && '$out/test_api'"
else
  names+=("c_test_api"); results+=("SKIPPED (no C compiler)"); secs+=(0)
fi
stage ops_meta_cpu 60 "$py" -m pytest -q -p no:cacheprovider python/tests/torch/test_ops_meta.py python/tests/test_capi.py
stage ops_gpu_tp1 150 env TE_COMM_TORCH_TP1=1 "$py" -m torch.distributed.run --standalone --nproc-per-node=1 \
  -m pytest -q -rfEsx -p no:cacheprovider python/tests/torch/test_ops.py
stage host_cost 90 "$py" bench/host_cost.py --out "$out/host_cost.md"

echo
echo "torch-ops-gpu summary (logs: $out)"
printf '| %-14s | %-16s | %5s |\n' stage result s
printf '|%s|%s|%s|\n' "----------------" "------------------" "-------"
for i in "${!names[@]}"; do
  printf '| %-14s | %-16s | %5s |\n' "${names[$i]}" "${results[$i]}" "${secs[$i]}"
done
[ -f "$out/host_cost.md" ] && { echo; grep -E '^\|.*(256³|4096³)|host_cost:' "$out/host_cost.md"; }
exit $fail
