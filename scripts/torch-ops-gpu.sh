#!/usr/bin/env bash
# The torch ops' layouts (transa / transb) and host cost on ONE GPU, without cargo:
#   TE_COMM_LIB=/path/libtransformer_engine_comm.so PYTHONPATH=python scripts/ops-gpu.sh
# Stages: the C contract test of the header (cc; no GPU needed), the CPU shape tests of the
# ops (meta / fake tensors), the torch GPU tests of the ops at tp 1 (torchrun, 1 rank:
# every layout against torch in fp32, the prepared-call path, CUDA graphs, torch.compile
# with aot_eager), and bench/host_cost.py (host µs per call; PASS/FAIL against 40 µs).
# Logs under $OUT (default ops-gpu-out/); a table last; exit status 1 when a stage failed.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/ops-gpu-out}
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
echo "ops-gpu summary (logs: $out)"
printf '| %-14s | %-16s | %5s |\n' stage result s
printf '|%s|%s|%s|\n' "----------------" "------------------" "-------"
for i in "${!names[@]}"; do
  printf '| %-14s | %-16s | %5s |\n' "${names[$i]}" "${results[$i]}" "${secs[$i]}"
done
[ -f "$out/host_cost.md" ] && { echo; grep -E '^\|.*(256³|4096³)|host_cost:' "$out/host_cost.md"; }
exit $fail
