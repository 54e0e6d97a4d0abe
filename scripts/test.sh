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
mkdir -p build
te_comm_cmake_build "$lib" "$root/build" -DTE_COMM_CUDA_ROOT="$cuda_root" -DTE_COMM_NCCL_ROOT="$root/.pydeps/nvidia/nccl"
ctest --test-dir "$root/build" --output-on-failure

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
rc=0
TE_COMM_LIB="$lib" PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}" \
  "$py" -m pytest -q -rsx -p no:cacheprovider "$root/python/tests" --ignore="$root/python/tests/torch" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests under python/tests: the Python binding went untested" >&2
  exit 1
fi
[ "$rc" -eq 0 ] || exit "$rc"

# The wheel, as `pip install .` builds it (pyproject.toml: hatchling + python/hatch_build.py,
# which runs the cargo build above again: nothing to rebuild). It must bundle the library and
# work from a plain install with TE_COMM_LIB unset, outside the source tree.
whl=$(mktemp -d /tmp/te_comm_wheel.XXXXXX)
trap 'rm -rf "$whl"' EXIT
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
