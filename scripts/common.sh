# Sourced by the scripts: repository root, the library to use, and the CMake build of
# tests_c against it. Never NVLink multicast (NVLS): it can take shared GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

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

gpu_count() {
  nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
}
