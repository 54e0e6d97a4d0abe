#!/usr/bin/env bash
# The test command (README): cargo tests, then the C/C++ tests through CTest.
# Works without a GPU: GPU tests then report SKIPPED (CTest "not run"), never passed.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cuda_root=$(bash "$root/scripts/install-deps.sh" | tail -n 1)
export LD_LIBRARY_PATH=$cuda_root/lib:$root/.pydeps/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

cd "$root"
cargo build --release
# NVRTC comes from the wheel above, so the kernel compilation test must really run.
NVTE_COMM_REQUIRE_NVRTC=1 cargo test --release
lib=$(te_comm_library)
mkdir -p build
te_comm_cmake_build "$lib" "$root/build" -DTE_COMM_CUDA_ROOT="$cuda_root" -DTE_COMM_NCCL_ROOT="$root/.pydeps/nvidia/nccl"
ctest --test-dir "$root/build" --output-on-failure
