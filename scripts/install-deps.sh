#!/usr/bin/env bash
# Install what building and testing needs on a machine without a GPU (CI, developers):
# cmake, g++, pkg-config and OpenMPI from Debian/Ubuntu packages (apt, only those missing),
# and the CUDA 13.0 runtime / NVRTC / NCCL 2.28 headers and libraries from pip wheels
# (matching the GPU machine) into a cache folder shared by every clone on the machine,
# one sub-folder per set of versions, installed once (into a temporary folder renamed into
# place: concurrent runs never see half a folder). Files nothing here uses are deleted
# after the install (the alternative NVRTC build, static CUDA libraries: about 115 MB).
# Prints the folder holding include/ and lib/ (for -DTE_COMM_CUDA_ROOT) on its last line;
# NCCL is its sibling folder ../nccl (for -DTE_COMM_NCCL_ROOT).
#
# Usage: scripts/install-deps.sh [--pip NAME SPEC...]
#   --pip NAME SPEC...  instead: pip-install SPECs (with their dependencies) into the shared
#                       folder NAME-<python tag>, once, and print that folder (for
#                       PYTHONPATH; scripts/test.sh's pytest and jax)
#   -h, --help          this text
# Environment:
#   TE_COMM_DEPS_DIR  the shared folder (default ${XDG_CACHE_HOME:-~/.cache}/transformer_engine_comm/deps)
#   PYTHON            the interpreter for pip (default python3)
# Needs: no GPU; network access to the package index on the first run (about 340 MB of
# wheels: NVRTC 110 MB, NCCL 215 MB), sudo or root only when apt packages are missing.
# Takes: about 30 s to a few minutes the first time (download), under 1 s afterwards.
set -euo pipefail
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
py=${PYTHON:-python3}
deps_root=${TE_COMM_DEPS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/transformer_engine_comm/deps}
export PIP_ROOT_USER_ACTION=ignore

# `shared_install DIR CMD...`: unless DIR is complete, run CMD with $target set to a new
# temporary folder beside DIR, mark it complete and rename it to DIR (atomic: a concurrent
# run either finds DIR whole or renames its own copy; the loser's copy is deleted).
shared_install() {
  local dir=$1; shift
  [ -f "$dir/.complete" ] && return 0
  mkdir -p "$(dirname "$dir")"
  # Leftovers of runs killed mid-install (a day old: no run takes that long).
  find "$(dirname "$dir")" -maxdepth 1 -name "$(basename "$dir").tmp.*" -mmin +1440 -exec rm -rf {} + 2>/dev/null || true
  target=$(mktemp -d "$dir.tmp.XXXXXX")
  chmod 755 "$target"
  # $target is global and set once per install: the trap reads it when it fires.
  trap 'rm -rf -- "$target"' EXIT
  "$@" || { echo "install-deps: installing into $dir failed" >&2; exit 1; }
  touch "$target/.complete"
  if [ -e "$dir" ] && [ ! -f "$dir/.complete" ]; then
    # An incomplete folder (not made by this script): set it aside, then delete it.
    local stale
    stale=$(mktemp -d "$dir.stale.XXXXXX")
    mv -T "$dir" "$stale/old" 2>/dev/null || true
    rm -rf "$stale"
  fi
  mv -T "$target" "$dir" 2>/dev/null || rm -rf "$target"
  trap - EXIT
  [ -f "$dir/.complete" ] || { echo "install-deps: $dir is incomplete" >&2; exit 1; }
}

if [ "${1:-}" = "--pip" ]; then
  [ $# -ge 3 ] || { echo "usage: $0 --pip NAME SPEC..." >&2; exit 2; }
  name=$2; shift 2
  tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  dir=$deps_root/$name-$tag
  pip_target() { "$py" -m pip install -q --disable-pip-version-check --target "$target" "$@" >&2; }
  shared_install "$dir" pip_target "$@"
  echo "$dir"
  exit 0
fi
[ $# -eq 0 ] || { echo "install-deps: unknown argument '$1' (see --help)" >&2; exit 2; }

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
# nccl.h includes cuda_fp16.h, which needs <nv/target> (nvidia-cuda-cccl). NCCL's library
# stays: the GPU test executables link it, and CTest starts each (its --probe) to skip it.
cuda_wheels() {
  "$py" -m pip install -q --disable-pip-version-check --no-deps --target "$target" \
    "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-crt==13.0.88" "nvidia-cuda-cccl==13.0.85" \
    "nvidia-cuda-nvrtc==13.0.88" "nvidia-nccl-cu13==2.28.3" >&2
  local cu=$target/nvidia/cu13 so lib
  # Unused here: the alternative NVRTC build, static and device-runtime archives, the
  # wheels' CMake files (tests_c finds the libraries by path).
  rm -rf "$cu"/lib/libnvrtc.alt.so.* "$cu"/lib/libnvrtc-builtins.alt.so.* "$cu"/lib/*.a "$cu/lib/cmake"
  [ -f "$cu/include/cuda_runtime.h" ] || { echo "cuda_runtime.h missing under $cu" >&2; return 1; }
  # The wheels ship versioned sonames only; give the linker the unversioned names.
  for lib in "$cu/lib/cudart" "$cu/lib/nvrtc" "$target/nvidia/nccl/lib/nccl"; do
    so=$(ls "$(dirname "$lib")/lib$(basename "$lib").so."* 2>/dev/null | head -n1 || true)
    [ -n "$so" ] || { echo "no lib$(basename "$lib").so.* under $(dirname "$lib")" >&2; return 1; }
    ln -sf "$(basename "$so")" "$(dirname "$lib")/lib$(basename "$lib").so"
  done
}
deps=$deps_root/cuda-13.0.96-nvrtc-13.0.88-nccl-2.28.3
shared_install "$deps" cuda_wheels
# The old per-clone folder, for anything still pointing there: a link to the shared one
# (an existing real .pydeps folder is left alone).
if [ -L "$root/.pydeps" ] || [ ! -e "$root/.pydeps" ]; then ln -sfn "$deps" "$root/.pydeps"; fi
echo "$deps/nvidia/cu13"
