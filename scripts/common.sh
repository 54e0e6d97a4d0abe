# Sourced by the scripts (an internal helper, not run on its own): repository root, the
# scripts' --help, the library to use, and the CMake build of tests_c against it. Never
# NVLink multicast (NVLS): it can take shared GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# `te_comm_help "$@"`, first thing in a script: with -h or --help among the arguments, print
# the script's leading comment block (the lines after the shebang up to the first line that
# is not a comment, '# ' stripped: its usage text) and exit 0, before any work.
te_comm_help() {
  local a
  for a in "$@"; do
    case $a in
      -h | --help)
        awk 'NR == 1 && /^#!/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "${BASH_SOURCE[1]:-$0}"
        exit 0
        ;;
    esac
  done
}

# The library: $TE_COMM_LIB, else target/release (built with cargo when cargo exists).
te_comm_library() {
  local lib=${TE_COMM_LIB:-$root/target/release/libtransformer_engine_comm.so}
  if [ -z "${TE_COMM_LIB:-}" ] && command -v cargo >/dev/null; then
    (cd "$root" && cargo build --release -q) >&2 || return 1
  fi
  [ -f "$lib" ] || { echo "no library at $lib: build it with 'cargo build --release' or set TE_COMM_LIB" >&2; return 1; }
  echo "$lib"
}

# Configure and build tests_c in $2 against library $1 (extra CMake args follow).
te_comm_cmake_build() {
  local lib=$1 dir=$2; shift 2
  mkdir -p "$dir"
  cmake -S "$root" -B "$dir" -DCMAKE_BUILD_TYPE=Release -DTE_COMM_LIB="$lib" "$@" >"$dir/configure.log" 2>&1 \
    || { cat "$dir/configure.log" >&2; return 1; }
  cmake --build "$dir" -j "$(nproc)" >"$dir/build.log" 2>&1 || { tail -n 60 "$dir/build.log" >&2; return 1; }
}

# Build a plain C++ benchmark against the CUDA toolkit (cudart, NVRTC, cuBLASLt; no cargo,
# no nvcc kernels): `build_cuda_bench NAME SRC BIN LOG`. The toolkit: $CUDA_HOME, else
# /usr/local/cuda, else nvcc's; the compiler: $CXX, else g++, else nvcc. The log starts
# with the build, then the commit and the GPU. Exit status 2 (build log tail printed) when
# it fails.
build_cuda_bench() {
  local name=$1 src=$2 bin=$3 log=$4
  local cuda=${CUDA_HOME:-/usr/local/cuda}
  if [ ! -d "$cuda/include" ] && command -v nvcc >/dev/null; then
    cuda=$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)
  fi
  [ -d "$cuda/include" ] || { echo "$name: no CUDA toolkit at $cuda (set CUDA_HOME)" >&2; return 2; }
  local libdir=$cuda/lib64
  [ -d "$libdir" ] || libdir=$cuda/lib
  local cxx=${CXX:-g++}
  command -v "$cxx" >/dev/null || cxx=$cuda/bin/nvcc
  echo "=== build ($cxx, CUDA at $cuda)" | tee "$log"
  "$cxx" -std=c++17 -O2 "$src" -I"$cuda/include" -L"$libdir" \
    -Wl,-rpath,"$libdir" -lcudart -lnvrtc -lcublasLt -o "$bin" >>"$log" 2>&1 || {
    tail -n 40 "$log"
    echo "$name: build failed" >&2
    return 2
  }
  (git -C "$root" rev-parse --short HEAD 2>/dev/null || echo "commit: unknown") >>"$log"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader >>"$log" 2>&1 || true
}

gpu_count() {
  nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
}

# The GPU scripts' steps: `step NAME LIMIT CMD...` runs CMD with the smaller of LIMIT and
# the time budget left (skipped under 20 s left), logs it to $step_logs/NAME.log (default
# $out/logs) and adds a summary row (the run's last "N passed" or bar line); a failure
# (77: a skip) sets fail=1. The caller sets out and `fail=0 rows=()`; with a budget, also
# budget (seconds) and t_start (its start, `date +%s`).
step() {
  local name=$1 lim=$2; shift 2
  local logs=${step_logs:-$out/logs}
  local left=$((${budget:-1000000} - ($(date +%s) - ${t_start:-$(date +%s)})))
  if [ "$left" -lt 20 ]; then rows+=("| $name | NOT RUN (time budget) | - | - |"); return; fi
  [ "$lim" -gt "$left" ] && lim=$left
  local t0=$(date +%s) rc
  mkdir -p "$logs"
  timeout -k 5 "$lim" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  local res=PASS
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then res="FAIL (timeout ${lim}s)"; fail=1
  elif [ $rc -eq 77 ]; then res=SKIPPED
  elif [ $rc -ne 0 ]; then res="FAIL (rc $rc)"; fail=1; fi
  local counts=$(grep -aE "[0-9]+ passed|^host-cost bar" "$logs/$name.log" | tail -n 1 |
    sed -E 's/^(.*[^0-9])?([0-9]+ passed)/\2/; s/ =+$//' | cut -c1-110)
  rows+=("| $name | $res | ${counts:--} | $(($(date +%s) - t0)) |")
  echo "$name: $res ($(($(date +%s) - t0)) s)"
}

# Old against new in one call: `old_vs_new NP LIMIT BENCH...` builds tests_c of the older
# tree in .mg/old (its library beside its CMakeLists.txt, cmake/, include/, tests_c/ and
# scripts/common.sh) against that library, then runs each benchmark with NP ranks from the
# old build and from $build, tables in $out/tables/{old,new}_BENCH_tpNP.md. Nothing when
# .mg/old holds no library. Needs what step needs, plus build and mpi.
old_vs_new() {
  local np=$1 lim=$2 b old=$root/.mg/old; shift 2
  [ -f "$old/libtransformer_engine_comm.so" ] || return 0
  mkdir -p "$out/tables"
  step old_build 90 bash -c "source '$old/scripts/common.sh' && te_comm_cmake_build '$old/libtransformer_engine_comm.so' '$old/build' -DTE_COMM_GPU_TESTS=ON"
  for b in "$@"; do
    step "old_${b}_tp$np" "$lim" "$mpi" "$np" "$old/build/tests_c/$b" --out "$out/tables/old_${b}_tp$np.md"
    step "new_${b}_tp$np" "$lim" "$mpi" "$np" "$build/tests_c/$b" --out "$out/tables/new_${b}_tp$np.md"
  done
}

# The summary table of the steps run.
step_table() {
  echo "| step | result | counts | seconds |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
}

# At most 8 files come back from the device machine: everything under $1 into one archive,
# results.tgz, beside summary.md.
pack_results() {
  local dir=$1
  if tar czf "$root/.step-results.tgz" -C "$dir" .; then
    find "$dir" -mindepth 1 -maxdepth 1 ! -name summary.md -exec rm -rf {} +
    mv "$root/.step-results.tgz" "$dir/results.tgz"
  fi
}
