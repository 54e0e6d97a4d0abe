#!/usr/bin/env bash
# The test command (README): cargo tests, the C/C++ tests through CTest, then the Python
# package: its binding tests (pytest) and its wheel (built, installed, imported).
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
tmp=$(mktemp -d /tmp/te_comm_test.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
mkdir -p build
# GPU tests ON (not AUTO): the runtime and NCCL from the wheels above must be found, so the
# GPU tests are always built here (and skip at run time without a GPU).
te_comm_cmake_build "$lib" "$root/build" -DTE_COMM_GPU_TESTS=ON \
  -DTE_COMM_CUDA_ROOT="$cuda_root" -DTE_COMM_NCCL_ROOT="$root/.pydeps/nvidia/nccl"
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
# package that point into that prefix. A C consumer is built with each and run.
prefix=$tmp/prefix
cmake --install "$root/build" --prefix "$prefix" >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log" >&2; exit 1; }
mkdir -p "$tmp/consumer"
cat >"$tmp/consumer/consumer.c" <<'C'
#include <stdio.h>
#include "transformer_engine_comm.h"
int main(void) { printf("%s\n", nvte_comm_version()); return 0; }
C
pc_path=$(dirname "$(find "$prefix" -name transformer_engine_comm.pc)")
pc() { PKG_CONFIG_PATH=$pc_path pkg-config "$@" transformer_engine_comm; }
# shellcheck disable=SC2046  # word splitting of the flags is intended
cc -std=c99 -Wall -Werror -o "$tmp/consumer/pc_consumer" "$tmp/consumer/consumer.c" \
  $(pc --cflags --libs) -Wl,-rpath,"$(pc --variable=libdir)"
cat >"$tmp/consumer/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.18)
project(consumer C)
find_package(TransformerEngineComm REQUIRED)
add_executable(cmake_consumer consumer.c)
target_link_libraries(cmake_consumer PRIVATE TransformerEngineComm::transformer_engine_comm)
CMAKE
cmake -S "$tmp/consumer" -B "$tmp/consumer/build" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/consumer.log" 2>&1 \
  && cmake --build "$tmp/consumer/build" >>"$tmp/consumer.log" 2>&1 || { cat "$tmp/consumer.log" >&2; exit 1; }
want=$(pc --modversion)
for exe in "$tmp/consumer/pc_consumer" "$tmp/consumer/build/cmake_consumer"; do
  got=$(env -u LD_LIBRARY_PATH "$exe")
  [ "$got" = "$want" ] || { echo "$(basename "$exe"): library version '$got', expected '$want'" >&2; exit 1; }
  libpath=$(env -u LD_LIBRARY_PATH ldd "$exe" | awk '/libtransformer_engine_comm/ { print $3 }')
  case "$(realpath "$libpath")" in
    "$(realpath "$prefix")"/*) ;;
    *) echo "$(basename "$exe") loads $libpath, not the copy under $prefix" >&2; exit 1 ;;
  esac
done
flags=$(pc --cflags --libs)
echo "install --prefix: pkg-config and find_package consumers build and run against $prefix (${flags% })"

# Python binding tests (python/tests: no GPU or torch needed; python/tests/torch is GPU-only
# and has its own runner). pytest comes from pip when the interpreter lacks it.
py=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
pydeps_pytest=$root/.pydeps/pytest
pypath=$root/python
if ! "$py" -c "import pytest" 2>/dev/null; then
  [ -d "$pydeps_pytest/pytest" ] || "$py" -m pip install -q --disable-pip-version-check --target "$pydeps_pytest" pytest >&2
  pypath=$pypath:$pydeps_pytest
fi
# jax (CPU wheels) for the JAX integration's host tests (python/tests/test_jax_host.py:
# the XLA FFI layouts against jaxlib's c_api.h, the exchanges, the lowering), which must run.
pydeps_jax=$root/.pydeps/jax
if ! "$py" -c "import jax" 2>/dev/null; then
  # Below 0.12: the versions the handlers and host tests were checked with (0.10, 0.11).
  [ -d "$pydeps_jax/jax" ] || "$py" -m pip install -q --disable-pip-version-check --target "$pydeps_jax" "jax<0.12" >&2
  pypath=$pypath:$pydeps_jax
fi
rc=0
TE_COMM_REQUIRE_JAX=1 TE_COMM_LIB="$lib" PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" \
  "$py" -m pytest -q -rsx -p no:cacheprovider "$root/python/tests" --ignore="$root/python/tests/torch" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests under python/tests: the Python binding went untested" >&2
  exit 1
fi
[ "$rc" -eq 0 ] || exit "$rc"

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
