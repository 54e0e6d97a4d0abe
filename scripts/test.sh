#!/usr/bin/env bash
# The test command (README): cargo tests, the C/C++ tests through CTest, C and C++ consumers
# of the installed library (pkg-config and CMake's find_package, built and run with nothing
# but what the install gives them), then the Python package: its binding tests (pytest) and
# its wheel (built, installed, imported). Works without a GPU: GPU tests then report
# SKIPPED (CTest "not run"), never passed.
# One cargo build serves the library and the tests; NVRTC's kernel compiles are cached on
# disk (the library's kernel cache, keyed by the full source, options and NVRTC version),
# so a warm run compiles none; downloads (CUDA/NCCL wheels, pytest, jax CPU wheels) go to a
# cache folder shared by every clone (scripts/install-deps.sh). Per-stage times at the end.
#
# Usage: scripts/test.sh
#   -h, --help  this text
# Environment:
#   TE_COMM_LIB                 test this prebuilt library (cargo tests still build their own)
#   TE_COMM_DEPS_DIR            the shared download folder (default
#                               ${XDG_CACHE_HOME:-~/.cache}/transformer_engine_comm/deps)
#   NVTE_COMM_CACHE_DIR         the kernel cache (default ${XDG_CACHE_HOME:-~/.cache}/transformer_engine_comm)
#   JAX_COMPILATION_CACHE_DIR   JAX's compilation cache for the host tests (default
#                               ${XDG_CACHE_HOME:-~/.cache}/transformer_engine_comm/jax-cache)
#   NVTE_COMM_DISABLE_KERNEL_CACHE=1  compile every kernel afresh (about 1-5 minutes more)
#   PYTHON                      the interpreter (default python3)
# Needs: no GPU (GPU tests are skipped and listed); Rust (cargo), python3 with pip, and what
# scripts/install-deps.sh installs (apt packages when missing, about 340 MB of CUDA/NCCL
# wheels and 250 MB of jax CPU wheels the first time on a machine); 2 cores, 4 GB memory.
# Takes: on 2 cores, about 4-8 minutes the first time on a machine (cargo build, downloads,
# NVRTC compiles), about 1 minute when nothing changed.
set -euo pipefail
source "$(dirname "$0")/common.sh"
te_comm_help "$@"
[ $# -eq 0 ] || { echo "test.sh: unknown argument '$1' (see --help)" >&2; exit 2; }

# Per-stage wall times, printed at the end (and on failure). EPOCHREALTIME needs bash 5;
# older bash (4.4: RHEL / Rocky 8) falls back to date.
now_s() { echo "${EPOCHREALTIME:-$(date +%s.%N)}"; }
stage_names=() stage_secs=() stage_t=$(now_s) stage_cur=""
stage() {
  local now
  now=$(now_s)
  if [ -n "$stage_cur" ]; then
    stage_names+=("$stage_cur")
    stage_secs+=("$(awk -v a="$stage_t" -v b="$now" 'BEGIN { printf "%.1f", b - a }')")
  fi
  stage_cur=$1 stage_t=$now
  [ -z "$stage_cur" ] || echo "=== test.sh: $stage_cur" >&2
}
stage_report() {
  stage ""
  local i
  echo "test.sh stage times (s):"
  for i in "${!stage_names[@]}"; do printf '  %-24s %6s\n' "${stage_names[$i]}" "${stage_secs[$i]}"; done
}
tmp=$(mktemp -d /tmp/te_comm_test.XXXXXX)
trap 'rc=$?; rm -rf "$tmp"; stage_report; exit $rc' EXIT

stage deps
cuda_root=$(bash "$root/scripts/install-deps.sh" | tail -n 1)
nccl_root=$(cd "$cuda_root/../nccl" && pwd)
export LD_LIBRARY_PATH=$cuda_root/lib:$nccl_root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

cd "$root"
# One cargo build: the test binaries and, as their dependency, the release library
# (target/release/libtransformer_engine_comm.so), the very build `cargo build --release`,
# te_comm_library and the wheel's build hook then find up to date.
stage "cargo build"
cargo test --release --no-run
stage "cargo test"
# NVRTC comes from the wheel above, so the kernel compilation test must really run (a
# real NVRTC compile on a kernel cache miss).
NVTE_COMM_REQUIRE_NVRTC=1 cargo test --release
stage "ctest build"
lib=$(te_comm_library)
# GPU tests ON (not AUTO): the runtime and NCCL from the wheels above must be found, so the
# GPU tests are always built here (and skip at run time without a GPU).
te_comm_cmake_build "$lib" "$root/build" -DTE_COMM_GPU_TESTS=ON \
  -DTE_COMM_CUDA_ROOT="$cuda_root" -DTE_COMM_NCCL_ROOT="$nccl_root"
stage ctest
ctest_rc=0
ctest --test-dir "$root/build" --output-on-failure | tee "$tmp/ctest.log" || ctest_rc=$?
# CTest counts skipped tests as passed ("100% tests passed"): list each with its reason,
# the SKIPPED line of its output (kept in Testing/Temporary/LastTest.log).
skipped=$(sed -n '/^The following tests did not run:/,/^$/p' "$tmp/ctest.log" \
  | sed -nE 's/^[[:space:]]*[0-9]+ - ([^ ]+) \((.*)\)$/\1 \2/p')
if [ -n "$skipped" ]; then
  echo "ctest: $(wc -l <<<"$skipped") test(s) not run:"
  while read -r name status; do
    why=$(awk -v t="$name" '
      /^[0-9]+\/[0-9]+ Test: / { cur = $0; sub(/^[0-9]+\/[0-9]+ Test: /, "", cur); on = (cur == t); next }
      on && /^<end of output>/ { exit }
      on && /SKIPPED/ { print; exit }' "$root/build/Testing/Temporary/LastTest.log")
    printf '  %-22s %s\n' "$name" "${why:-$status}"
  done <<<"$skipped"
fi
[ "$ctest_rc" -eq 0 ] || exit "$ctest_rc"

# The install tree: `cmake --install` with a prefix given only at install time (the build
# above was configured with the default one) must give a pkg-config file and a CMake
# package that point into that prefix. C and C++ consumers are built with each exactly as
# a user would (no rpath or library path of our own) and run with LD_LIBRARY_PATH unset:
# the .pc's Libs carry the rpath; CMake gives an imported target's folder to the build rpath.
stage "install + consumers"
prefix=$tmp/prefix
cmake --install "$root/build" --prefix "$prefix" >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log" >&2; exit 1; }
mkdir -p "$tmp/consumer"
cat >"$tmp/consumer/consumer.c" <<'C'
#include <stdio.h>
#include "transformer_engine_comm.h"
int main(void) { printf("%s\n", nvte_comm_version()); return 0; }
C
cat >"$tmp/consumer/consumer.cpp" <<'CPP'
#include <cstdio>
#include "transformer_engine_comm.h"
int main() { std::printf("%s\n", nvte_comm_version()); return 0; }
CPP
pc_path=$(dirname "$(find "$prefix" -name transformer_engine_comm.pc)")
pc() { PKG_CONFIG_PATH=$pc_path pkg-config "$@" transformer_engine_comm; }
# shellcheck disable=SC2046  # word splitting of the flags is intended
(cd "$tmp/consumer" && env -u LD_LIBRARY_PATH cc -std=c99 -Wall -Werror -o pc_consumer consumer.c \
  $(pc --cflags --libs))
cat >"$tmp/consumer/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.18)
project(consumer C CXX)
find_package(TransformerEngineComm REQUIRED)
add_executable(cmake_consumer consumer.c)
target_link_libraries(cmake_consumer PRIVATE TransformerEngineComm::transformer_engine_comm)
add_executable(cmake_consumer_cxx consumer.cpp)
target_link_libraries(cmake_consumer_cxx PRIVATE TransformerEngineComm::transformer_engine_comm)
CMAKE
(env -u LD_LIBRARY_PATH cmake -S "$tmp/consumer" -B "$tmp/consumer/build" -DCMAKE_PREFIX_PATH="$prefix" \
  && env -u LD_LIBRARY_PATH cmake --build "$tmp/consumer/build") >"$tmp/consumer.log" 2>&1 \
  || { cat "$tmp/consumer.log" >&2; exit 1; }
want=$(pc --modversion)
for exe in "$tmp/consumer/pc_consumer" "$tmp/consumer/build/cmake_consumer" "$tmp/consumer/build/cmake_consumer_cxx"; do
  got=$(env -u LD_LIBRARY_PATH "$exe") || { echo "$(basename "$exe") does not run without LD_LIBRARY_PATH" >&2; exit 1; }
  [ "$got" = "$want" ] || { echo "$(basename "$exe"): library version '$got', expected '$want'" >&2; exit 1; }
  libpath=$(env -u LD_LIBRARY_PATH ldd "$exe" | awk '/libtransformer_engine_comm/ { print $3 }')
  case "$(realpath "$libpath")" in
    "$(realpath "$prefix")"/*) ;;
    *) echo "$(basename "$exe") loads $libpath, not the copy under $prefix" >&2; exit 1 ;;
  esac
done
flags=$(pc --cflags --libs)
echo "install --prefix: pkg-config (C) and find_package (C, C++) consumers build and run, without LD_LIBRARY_PATH, against $prefix (${flags% })"

# Python binding tests (python/tests: no GPU or torch needed; python/tests/torch is GPU-only
# and has its own runner). pytest comes from pip when the interpreter lacks it.
stage "python deps"
py=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
pypath=$root/python
if ! "$py" -c "import pytest" 2>/dev/null; then
  pypath=$pypath:$(bash "$root/scripts/install-deps.sh" --pip pytest pytest | tail -n 1)
fi
# jax (CPU wheels) for the JAX integration's host tests (python/tests/test_jax_host.py:
# the XLA FFI layouts against jaxlib's c_api.h, the exchanges, the lowering), which must run.
if ! "$py" -c "import jax" 2>/dev/null; then
  # Below 0.12: the versions the handlers and host tests were checked with (0.10, 0.11).
  pypath=$pypath:$(bash "$root/scripts/install-deps.sh" --pip jax-lt0.12 "jax<0.12" | tail -n 1)
fi
stage pytest
rc=0
# JAX's persistent compilation cache (CPU executables, keyed by JAX on the program, the jaxlib
# version and the flags): a warm run compiles none of the host tests' jitted steps (about 45 s
# of the JAX tests on 2 cores). Shared by clones, beside the download folder.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/transformer_engine_comm/jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=${JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES:-0}
TE_COMM_REQUIRE_JAX=1 TE_COMM_LIB="$lib" PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" \
  "$py" -m pytest -q -rsx -p no:cacheprovider "$root/python/tests" --ignore="$root/python/tests/torch" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests under python/tests: the Python binding went untested" >&2
  exit 1
fi
[ "$rc" -eq 0 ] || exit "$rc"

stage wheel
# The wheel, as `pip install .` builds it (pyproject.toml: hatchling + python/hatch_build.py,
# which runs the cargo build above again: nothing to rebuild). It must bundle the library and
# work from a plain install with TE_COMM_LIB unset, outside the source tree.
whl=$tmp/wheel
mkdir -p "$whl"
"$py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$whl/dist" "$root" >&2
"$py" - "$whl/dist" <<'PY'
import glob, sys, zipfile
wheels = glob.glob(sys.argv[1] + "/*.whl")
assert len(wheels) == 1, wheels
names = set(zipfile.ZipFile(wheels[0]).namelist())
need = {"transformer_engine_comm/libtransformer_engine_comm.so", "transformer_engine_comm/__init__.py",
        "transformer_engine_comm/_capi.py"}
assert need <= names, f"{wheels[0]} lacks {sorted(need - names)}"
assert "-py3-none-" in wheels[0], wheels[0]
# Package indexes accept manylinux tags, not linux_*: the build hook derives the tag from
# the library's own ELF needs (python/hatch_build.py: manylinux_platform).
assert "-py3-none-manylinux_" in wheels[0], wheels[0]
print("wheel:", wheels[0].rsplit("/", 1)[1], f"({len(names)} files)")
PY
"$py" -m pip install -q --disable-pip-version-check --no-deps --no-index --target "$whl/site" "$whl"/dist/*.whl >&2
(cd "$whl" && env -u TE_COMM_LIB PYTHONPATH="$whl/site" "$py" -c '
import os, sys, transformer_engine_comm as t
here = os.path.realpath(os.path.dirname(t.__file__))
assert here == os.path.realpath(os.path.join(sys.argv[1], "transformer_engine_comm")), here
assert t.library_path() == os.path.join(here, "libtransformer_engine_comm.so"), t.library_path()
assert t.version() == t.__version__, (t.version(), t.__version__)
print("installed wheel: transformer_engine_comm", t.version(), "from", t.library_path())
' "$whl/site")
