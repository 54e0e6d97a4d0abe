#!/usr/bin/env bash
# The overlap benchmark with an emulated link on one GPU, in one call: builds
# bench/own_gemm_link.cpp (plain C++ against the CUDA toolkit: cudart, NVRTC, cuBLASLt; our
# kernel kernels/gemm_sm90.cu compiled by NVRTC with the library's options; no cargo) and
# runs it: per row (AG and RS per-rank anchor shapes, bf16 and e4m3, tp 4 and 8), our fused
# kernel and the chunked cuBLASLt algorithm against a paced link (flags only, and real
# copy-engine copies), next to the GEMM alone, our kernel alone and the link alone; every
# fused / chunked result checked. Method and columns: the header of bench/own_gemm_link.cpp.
# Where the start-up check finds that the copies are kernels (so far on every H100 and H200),
# the copies variant is skipped in the first pass and a second pass
# (own_gemm_link_sm_budget.md) runs both variants with the GEMMs on SMs - LINK_COPY_SMS.
#
# Usage: scripts/emulated-link-gpu.sh [own_gemm_link options]
#   options go to the benchmark: --quick --iters N --bw GBPS --pieces P --k-pieces --me R
#   --only ag|rs --dtype bf16|e4m3 --tp 8 --budget S --gemm-sms N --bn 128
#   --copy-api memcpy|batch ...
#   (--pieces: AG flags / RS done signals and transfers per block, default 4; --k-pieces: the
#   all-gather's pieces as K slices; --copy-api: the copies variant's API, default batch =
#   cudaMemcpyBatchAsync with the hint to overlap with compute, falling back to
#   cudaMemcpyAsync where refused; --budget: no row starts after S seconds, default 150, the
#   table still comes out)
#   -h, --help  this text
# Environment:
#   OUT              output folder (default emulated-link-out/)
#   LINK_LIMIT       seconds before the first pass is killed (default 200)
#   LINK_LIMIT2      the same for the second pass, which starts no row after 60 s (default 80)
#   LINK_COPY_SMS    SMs left to the copies in the second pass (default 16)
#   LINK_TUNED=1     the autotuner's view as well (bench/link_tuned.py): the fused candidates
#                    the library's tuner has (src/tune.rs: the tile rule's width, 128-wide
#                    tiles with --bn 128, and for the all-gather 8 pieces, --pieces 8: 8 K
#                    slices with --k-pieces; use --k-pieces: with row pieces the default
#                    pass's 4 pieces are not one of the tuner's) each in a pass of their own,
#                    twice; the first set picks per row, the second is reported
#                    (own_gemm_link_tuned.md); a pass's failure fails the script
#   LINK_LIMIT_TUNED seconds per tuned pass (default 60)
#   CUDA_HOME        the CUDA toolkit (default /usr/local/cuda, else nvcc's); CXX (default g++)
# Needs: one Hopper GPU (H100 / H200); the CUDA toolkit (headers, cudart, NVRTC, cuBLASLt)
# and g++ or nvcc; python3 for LINK_TUNED=1. No cargo, no library build.
# Takes: about 20 s a pass on an H100; build and both passes under 5 minutes; LINK_TUNED=1
# adds 5 passes of 10-20 s (2-3 minutes).
# Output: under $OUT: own_gemm_link.log (everything), own_gemm_link.md (the full table and
# bar lines), the binary; a short table and the bar lines printed last. Exit status: the
# benchmark's (1: a wrong result, a hang or a pacer timeout; 2: a setup error; 124: out of
# time), 2 for a failed build. On a hang the program prints where it is stuck ('  hang:'
# lines: stream states, the pacer's mirror, the verification run's steps, device words) and
# the table of the rows done so far.
set -u
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
out=${OUT:-$root/emulated-link-out}
mkdir -p "$out"
log=$out/own_gemm_link.log
md=$out/own_gemm_link.md
rm -f "$md"
build_cuda_bench emulated-link-gpu "$root/bench/own_gemm_link.cpp" "$out/own_gemm_link" "$log" || exit 2
cd "$root"
echo "=== own_gemm_link $*" | tee -a "$log"
# Three streams (compute, pacer, copies) should sit on separate hardware queues, or the
# overlap serializes (correctness does not depend on it: our kernel only waits on words the
# resident pacer writes); 8 (the default) is plenty, set so that no environment asks for fewer.
export CUDA_DEVICE_MAX_CONNECTIONS=8
# The full log goes to the file; the console gets the per-row summaries, then the table.
limit=${LINK_LIMIT:-200}
# One pass: `link LIMIT_S TABLE ARGS...` (only the plain kernels: the feature kernels would
# add ~30 s of NVRTC).
link() {
  local lim=$1 table=$2
  shift 2
  timeout -k 5 "$lim" "$out/own_gemm_link" --kernel "$root/kernels/gemm_sm90.cu" --define GEMM90_NO_EPI=1 \
    --define GEMM90_NO_FPACC=1 --define GEMM90_NO_NN_NT=1 --out "$table" "$@" >>"$log" 2>&1
}
link "$limit" "$md" "$@"
rc=$?
grep -aE '^(device:|pacer:|copies|copy-engine|note:|registers|link:|row |  Lt |  not timed|  beside|  [0-9]+ pieces|HANG|  hang:|  timeline|  pacer:|own_gemm_link:)|wrong|differ|timed out' "$log" |
  cut -c1-600
[ $rc -eq 124 ] && echo "emulated-link-gpu: out of time ($limit s)" | tee -a "$log"
echo
if [ -f "$md" ]; then
  # The short table: op, in, tp, shape, link, bound, fused, chunked, the ratios, ok.
  awk -F'|' '/^\| op \|/{
      print "| op | in | tp | shape | link | bound | fused | chunked | fused/bound | chunked/bound | f vs c | ok |"
      print "|---|---|---|---|---|---|---|---|---|---|---|---|"; next }
    /^\| (AG|RS) \|/{
      printf "|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s|\n", $2,$3,$4,$5,$6,$10,$11,$12,$13,$14,$15,$17 }' "$md"
  echo
  grep -E '^- ' "$md"
else
  echo "(no table: see $log)"
  tail -n 20 "$log"
fi
# Same-device copies are kernels on the H100 / H200 (bench/RESULTS.md, 2026-11-26):
# beside our kernel on every SM they cannot run, so the check skips the copies
# variant. Then a second pass runs both variants with the GEMMs on SMs - LINK_COPY_SMS
# (default 16: these copies are kernels, where a real link's peer copies run on copy
# engines and the library's fused kernels then leave only 2 SMs to the flag kernels),
# the copies on the SMs left free; the bound stays the GEMM alone on all SMs.
if [ -f "$md" ] && grep -q '^- real copies: NOT RUN' "$md" && [[ " $* " != *" --gemm-sms "* ]]; then
  free=${LINK_COPY_SMS:-16}
  sms=$(grep -aom1 '^device: .*, \([0-9]*\) SMs' "$log" | grep -o '[0-9]* SMs' | grep -o '[0-9]*')
  [ -n "$sms" ] && [ "$sms" -gt "$free" ] || sms=132
  md2=$out/own_gemm_link_sm_budget.md
  echo "=== second pass: the copies variant with the GEMMs on $((sms - free)) SMs (--gemm-sms)" | tee -a "$log"
  link "${LINK_LIMIT2:-80}" "$md2" --budget 60 "$@" --gemm-sms $((sms - free))
  rc2=$?
  [ -f "$md2" ] && grep -E '^- ' "$md2"
  # (the first pass's 2 only says that its copies variant did not run: the second's status
  # decides)
  { [ $rc -eq 0 ] || [ $rc -eq 2 ]; } && rc=$rc2
fi
if [ "${LINK_TUNED:-0}" = 1 ] && [ -f "$md" ]; then
  echo "=== the autotuner's candidates (LINK_TUNED=1): narrow and slices8, then all three again" | tee -a "$log"
  lim=${LINK_LIMIT_TUNED:-60}
  # (exit 2 only says that the copies variant did not run; 1 or a timeout fails the script)
  tpass() {
    link "$lim" "$@"
    local r=$?
    [ $r -ne 0 ] && [ $r -ne 2 ] && { echo "emulated-link-gpu: tuned pass $1 exit $r" | tee -a "$log"; rc=1; }
  }
  tpass "$out/tuned_narrow_1.md" --budget 45 "$@" --bn 128
  tpass "$out/tuned_slices8_1.md" --budget 45 "$@" --pieces 8 --only ag
  tpass "$out/tuned_default_2.md" --budget 45 "$@"
  tpass "$out/tuned_narrow_2.md" --budget 45 "$@" --bn 128
  tpass "$out/tuned_slices8_2.md" --budget 45 "$@" --pieces 8 --only ag
  python3 "$root/bench/link_tuned.py" --tune default="$md" narrow="$out/tuned_narrow_1.md" \
    slices8="$out/tuned_slices8_1.md" --report default="$out/tuned_default_2.md" \
    narrow="$out/tuned_narrow_2.md" slices8="$out/tuned_slices8_2.md" --out "$out/own_gemm_link_tuned.md" |
    grep -E '^- ' || { echo "emulated-link-gpu: link_tuned.py failed"; rc=1; }
fi
echo "emulated-link-gpu: exit $rc (log $log)"
exit $rc
