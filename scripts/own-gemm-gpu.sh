#!/usr/bin/env bash
# Our own Hopper GEMM (kernels/gemm_sm90.cu; the library's fused algorithms launch its plain
# TN kernels) checked and timed on one GPU, in one call: builds bench/own_gemm.cpp (plain C++
# against the CUDA toolkit: cudart, NVRTC, cuBLASLt; no cargo, no nvcc kernels) and runs it:
# correctness on small / odd shapes and the per-rank anchor shapes at tp 2/4/8 (bf16 and
# e4m3) against an fp32 reference GEMM and fp64 CPU samples, speed against cuBLASLt, the
# cost of pre-set arrival flags, an AG-style run whose row blocks arrive by copy engine
# while the kernel runs, and one where a block never arrives (the waits must give up after
# their time and record the flag); then the feature cases (every input / output type, the epilogues,
# FP8 output with d_scale and amax, full-precision FP8 accumulation, NN / NT layouts) at
# small and odd shapes against fp32 + fp64 references, and the precision test of
# full-precision against fast FP8 accumulation at k = 8192. A summary line per feature, the
# markdown table last.
# Passes: "base" (the kernel as committed, the library's exact NVRTC options) decides the
# exit status; "unstaged" (-DGEMM90_EPI_STAGED=0) and "narrow" (also -DGEMM90_EPI_WIDE=0)
# are A/B runs of the epilogue in the same call, reported in the summary.
#
# Usage: scripts/own-gemm-gpu.sh [own_gemm options]
#   options go to the benchmark: --quick --iters N --bn 128|192|256 --group G --no-fp8
#   --no-features --features-only --no-give-up --define GEMM90_STAGES_256=3 ...
#   --shape TOKENS,K,M,DTYPE (one timed case only, DTYPE 0 bf16 / 1 e4m3: for profilers
#   such as ncu)
#   -h, --help  this text
# Environment:
#   OUT                output folder for the log and binary (default own-gemm-out/)
#   OWN_GEMM_VARIANTS  the passes (default "base unstaged"; also "narrow")
#   CUDA_HOME          the CUDA toolkit (default /usr/local/cuda, else nvcc's); CXX (default g++)
# Needs: one Hopper GPU (H100 / H200); the CUDA toolkit (headers, cudart, NVRTC, cuBLASLt)
# and g++ or nvcc. No cargo, no library build.
# Takes: about 1-2 minutes a pass (each at most 280 s), two passes by default.
# Output: the log under $OUT; exit status own_gemm's of the base pass (1: a wrong result or
# a hang, 2: a setup error or a failed build).
set -u
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
out=${OUT:-$root/own-gemm-out}
mkdir -p "$out"
build_cuda_bench own-gemm-gpu "$root/bench/own_gemm.cpp" "$out/own_gemm" "$out/own_gemm.log" || exit 2
cd "$root"
# Passes: "base" (the kernel as committed, the library's exact NVRTC options) decides the
# exit status; "unstaged" (-DGEMM90_EPI_STAGED=0: the plain bf16-out kernels store
# straight from registers after quad transposes, as before the staged epilogue) and
# "narrow" (that, with -DGEMM90_EPI_WIDE=0: 4- or 8-byte stores) are A/B runs in the same
# call, reported in the summary. OWN_GEMM_VARIANTS picks (default "base unstaged").
rc=0
summary=()
for v in ${OWN_GEMM_VARIANTS:-base unstaged}; do
  case $v in
    base) extra=() ;;
    unstaged) extra=(--define GEMM90_EPI_STAGED=0) ;;
    narrow) extra=(--define GEMM90_EPI_STAGED=0 --define GEMM90_EPI_WIDE=0) ;;
    *) echo "own-gemm-gpu: unknown variant $v" >&2; exit 2 ;;
  esac
  echo "=== pass $v: own_gemm ${extra[*]} $*" | tee -a "$out/own_gemm.log"
  timeout -k 10 280 "$out/own_gemm" --kernel "$root/kernels/gemm_sm90.cu" ${extra[@]+"${extra[@]}"} "$@" 2>&1 |
    tee "$out/own_gemm_$v.log" | tee -a "$out/own_gemm.log"
  prc=${PIPESTATUS[0]}
  [ $prc -eq 124 ] && echo "own-gemm-gpu: pass $v timed out (280 s)" | tee -a "$out/own_gemm.log"
  [ "$v" = base ] && rc=$prc
  summary+=("pass $v: exit $prc; $(grep -E '^- (bf16|e4m3|flag|small|feature|tile|overall)' "$out/own_gemm_$v.log" | tr '\n' ' ')")
done
echo
printf '%s\n' "${summary[@]}" | tee -a "$out/own_gemm.log"
exit $rc
