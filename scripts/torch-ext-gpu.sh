#!/usr/bin/env bash
# The PyTorch C++ extension example end to end: installs the library and header with CMake
# into a temporary prefix, builds examples/torch_extension against it (pkg-config, via
# torch.utils.cpp_extension.load), and runs its driver run.py under torchrun on 2 GPUs and
# on 4 when present (or on the rank counts given).
#
# Usage: scripts/torch-ext-gpu.sh [NGPUS...]
#   NGPUS       rank counts to run (default: 2, and 4 when 4 GPUs are present)
#   -h, --help  this text
# Environment: TE_COMM_LIB (else target/release, built by cargo when present), OUT (default
# gpu-out/; logs go to $OUT/torch_ext), PYTHON (default python3), TE_COMM_TEST_TIMEOUT
# (seconds per rank count, default 300).
# Needs: 2 or more GPUs; PyTorch with CUDA and NCCL, a C++ compiler and ninja (torch's
# extension build) and CMake (pkg-config optional); cargo only without TE_COMM_LIB. Exit 77
# (skipped) with fewer than 2 GPUs, nothing run.
# Takes: about 2-5 minutes, most of it the extension's build (at most 600 s).
# Output: logs under $OUT/torch_ext/ and a table last; exit non-zero on any failure.
set -uo pipefail
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
out=${OUT:-$root/gpu-out}/torch_ext
mkdir -p "$out"
log=$out/torch_ext.log
: >"$log"
export NVTE_COMM_CACHE_DIR=${NVTE_COMM_CACHE_DIR:-/tmp/te_comm_kernel_cache}
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
# The interpreter's own bin folder first: ninja (torch's extension builds) and cmake may be
# pip packages installed beside it.
pybin=$(dirname "$("$py" -c 'import sys; print(sys.executable)')") || { echo "no $py" >&2; exit 1; }
export PATH="$pybin:$PATH"

ngpu=$(gpu_count)
if [ "$#" -gt 0 ]; then nps=("$@"); else nps=(); for n in 2 4; do [ "$n" -le "$ngpu" ] && nps+=("$n"); done; fi
echo "GPUs: $ngpu; rank counts: ${nps[*]:-none}; $("$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1)" | tee -a "$log"
if [ "${#nps[@]}" -eq 0 ]; then echo "torch-ext-gpu: SKIPPED (needs 2 GPUs)" | tee -a "$log"; exit 77; fi

lib=$(te_comm_library) || exit 1
work=$(mktemp -d /tmp/te_comm_torch_ext.XXXXXX)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix

# 1. Install library + header + pkg-config file + CMake package. The prefix is given at
#    configure time here (scripts/test.sh checks one given only to `cmake --install --prefix`).
echo "=== cmake install into $prefix (library $lib)" | tee -a "$log"
te_comm_cmake_build "$lib" "$work/build" -DTE_COMM_GPU_TESTS=OFF -DCMAKE_INSTALL_PREFIX="$prefix" 2>>"$log" \
  || { echo "torch-ext-gpu: FAIL (cmake configure/build; see $log)"; tail -n 30 "$log"; exit 1; }
cmake --install "$work/build" >>"$log" 2>&1 || { echo "torch-ext-gpu: FAIL (cmake --install)"; tail -n 30 "$log"; exit 1; }
pc=$(find "$prefix" -name transformer_engine_comm.pc | head -n 1)
[ -n "$pc" ] || { echo "torch-ext-gpu: FAIL (no transformer_engine_comm.pc under $prefix)" | tee -a "$log"; exit 1; }
export PKG_CONFIG_PATH=$(dirname "$pc")${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
{ echo "--- $pc"; cat "$pc"; command -v pkg-config >/dev/null && pkg-config --cflags --libs transformer_engine_comm; } >>"$log" 2>&1

# 2. Build the extension once, outside torchrun (the ranks then only load it).
export TORCH_EXTENSIONS_DIR=$work/torch_extensions
echo "=== build the extension" | tee -a "$log"
timeout -k 10 600 "$py" "$root/examples/torch_extension/build_ext.py" -v >>"$log" 2>&1 \
  || { echo "torch-ext-gpu: FAIL (extension build; see $log)"; tail -n 40 "$log"; exit 1; }
tail -n 1 "$log"

# 3. Run the driver on each rank count.
fail=0
rows=()
for np in "${nps[@]}"; do
  rlog=$out/run_np$np.log
  echo "=== run.py np=$np (log $rlog)" | tee -a "$log"
  t0=$(date +%s)
  timeout -k 10 "${TE_COMM_TEST_TIMEOUT:-300}" "$py" -m torch.distributed.run --standalone --nproc-per-node="$np" \
    "$root/examples/torch_extension/run.py" >"$rlog" 2>&1
  rc=$?
  closing=$(grep -E '^torch_extension: [0-9]+ passed' "$rlog" | tail -n 1)
  result=PASS
  if [ $rc -eq 124 ]; then result="FAIL (wall timeout)"; fail=1; elif [ $rc -ne 0 ] || [ -z "$closing" ]; then result="FAIL (rc $rc)"; fail=1; fi
  [ $rc -ne 0 ] && grep -E 'FAIL|Error|error' "$rlog" | head -n 20
  rows+=("| torch_extension | $np | $result | ${closing#torch_extension: } | $(( $(date +%s) - t0 )) |")
done

{
  echo "| test | ranks | result | counts | seconds |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$out/summary.md"
exit $fail
