#!/usr/bin/env bash
# One-GPU HBM streaming probe (bench/hbm_probe.cu, built here with nvcc for sm_90a): the
# amax / rowwise-cast / copy traffic of the FP8 quantization kernels by technique, against
# the device's nominal HBM bandwidth and cudaMemcpy. Writes $OUT/hbm_probe.txt (default
# quant-probe-out/); PROBE_ARGS go to the probe (--numel, --iters, --rounds, --nominal).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/quant-probe-out}
mkdir -p "$out"
cuda=${CUDA_HOME:-/usr/local/cuda}
nvcc=$cuda/bin/nvcc
command -v "$nvcc" >/dev/null || nvcc=nvcc
bin=$out/hbm_probe
"$nvcc" -std=c++17 -O3 -arch=sm_90a "$root/bench/hbm_probe.cu" -o "$bin" >"$out/hbm_probe_build.log" 2>&1 \
  || { tail -n 40 "$out/hbm_probe_build.log"; echo "quant-probe: build failed" >&2; exit 2; }
"$bin" ${PROBE_ARGS:-} | tee "$out/hbm_probe.txt"
rm -f "$bin"
