#!/usr/bin/env bash
# HBM streaming probe on one GPU (bench/hbm_probe.cu, built here with nvcc for sm_90a): the
# amax / rowwise-cast / copy traffic of the FP8 quantization kernels by technique, against
# the device's nominal HBM bandwidth and cudaMemcpy. Not part of the library.
#
# Usage: scripts/hbm-probe-gpu.sh
#   -h, --help  this text (no options otherwise)
# Environment:
#   OUT         output folder (default hbm-probe-out/): hbm_probe.txt, the build log
#   PROBE_ARGS  options for the probe: --numel N, --iters N, --rounds N, --nominal GBPS
#   CUDA_HOME   the CUDA toolkit (default /usr/local/cuda; else nvcc on PATH)
# Needs: one Hopper GPU (H100 / H200, sm_90a) and nvcc. No cargo, no library.
# Takes: about a minute (the nvcc build, then the probe).
# Output: the probe's table, also in $OUT/hbm_probe.txt; exit 2 when the build fails.
set -u
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
out=${OUT:-$root/hbm-probe-out}
mkdir -p "$out"
cuda=${CUDA_HOME:-/usr/local/cuda}
nvcc=$cuda/bin/nvcc
command -v "$nvcc" >/dev/null || nvcc=nvcc
bin=$out/hbm_probe
"$nvcc" -std=c++17 -O3 -arch=sm_90a "$root/bench/hbm_probe.cu" -o "$bin" >"$out/hbm_probe_build.log" 2>&1 \
  || { tail -n 40 "$out/hbm_probe_build.log"; echo "hbm-probe-gpu: build failed" >&2; exit 2; }
"$bin" ${PROBE_ARGS:-} | tee "$out/hbm_probe.txt"
rm -f "$bin"
