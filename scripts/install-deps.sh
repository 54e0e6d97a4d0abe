#!/usr/bin/env bash
# Install what building and testing needs on a machine without a GPU (CI, developers):
# cmake + OpenMPI from Debian/Ubuntu packages, and the CUDA 13.0 runtime / NVRTC / NCCL
# 2.28 headers and libraries from pip wheels into .pydeps/ (matching the GPU machine).
# Prints the folder holding include/ and lib/ (for -DTE_COMM_CUDA_ROOT) on its last line.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
deps=$root/.pydeps

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v mpicxx >/dev/null || need_apt+=(libopenmpi-dev openmpi-bin)
command -v g++ >/dev/null || need_apt+=(g++)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  # apt (seen once: "dpkg-deb: error: failed to read archive") can fail on a broken
  # download; one retry after cleaning the package cache, saying what failed.
  apt_install() {
    $SUDO apt-get update -qq >&2 &&
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >&2
  }
  if ! apt_install; then
    echo "install-deps: apt-get install ${need_apt[*]} failed; cleaning the package cache and retrying once" >&2
    $SUDO apt-get clean >&2 || true
    apt_install || { echo "install-deps: apt-get install ${need_apt[*]} failed twice" >&2; exit 1; }
  fi
fi

# CUDA 13.0 / NCCL 2.28 wheels. cuda_runtime.h needs crt/host_config.h (nvidia-cuda-crt);
# nccl.h includes cuda_fp16.h, which needs <nv/target> (nvidia-cuda-cccl).
stamp=$deps/.stamp-13.0-2.28.3
if [ ! -f "$stamp" ]; then
  rm -rf "$deps"
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$deps" \
    "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-crt==13.0.88" "nvidia-cuda-cccl==13.0.85" \
    "nvidia-cuda-nvrtc==13.0.88" "nvidia-nccl-cu13==2.28.3" >&2
  touch "$stamp"
fi
cu=$deps/nvidia/cu13
[ -f "$cu/include/cuda_runtime.h" ] || { echo "cuda_runtime.h missing under $cu" >&2; exit 1; }
# The wheels ship versioned sonames only; give the linker the unversioned names.
for lib in cudart nvrtc; do
  so=$(ls "$cu"/lib/lib$lib.so.* 2>/dev/null | head -n1 || true)
  [ -n "$so" ] && ln -sf "$(basename "$so")" "$cu/lib/lib$lib.so"
done
nccl=$(ls "$deps"/nvidia/nccl/lib/libnccl.so.* 2>/dev/null | head -n1 || true)
[ -n "$nccl" ] && ln -sf "$(basename "$nccl")" "$deps/nvidia/nccl/lib/libnccl.so"
echo "$cu"
