#!/usr/bin/env bash
# The main job (README): the overlap benchmark on all local GPUs, one MPI rank per GPU,
# all ranks one tensor-parallel group. Per anchor shape and algorithm: GEMM alone, NCCL
# alone, NCCL then GEMM, ours, ours / max(GEMM, NCCL).
# (TE_COMM_LIB=<path> uses a prebuilt library; else cargo builds one.)
set -euo pipefail
source "$(dirname "$0")/common.sh"

usage() {
  cat <<'EOF'
Usage: scripts/bench.sh [NGPUS] [--only ag|rs] [--iters N] [--out FILE]

The overlap benchmark (tests_c/bench_overlap) on NGPUS GPUs (default: every GPU nvidia-smi
lists), one MPI rank per GPU, all ranks one tensor-parallel group. Options in any order:
  NGPUS          number of GPUs / MPI ranks (default: all local GPUs)
  --only ag|rs   only the all-gather + GEMM or only the GEMM + reduce-scatter algorithms
  --iters N      timed iterations per measurement
  --out FILE     also write the markdown table to FILE
  -h, --help     this text
Needs a GPU machine (one or more GPUs; NGPUS of them usable) with the CUDA runtime, NCCL,
MPI and CMake; cargo only without TE_COMM_LIB. Environment: TE_COMM_LIB (a prebuilt
library, else `cargo build --release`), TE_COMM_BUILD_DIR (default build-gpu/),
TE_COMM_CUDA_ROOT / TE_COMM_NCCL_ROOT (CUDA runtime / NCCL folders when not installed).
Takes a few minutes: the first build of tests_c, then the measurements (faster with
--only or fewer --iters). Writes the build under TE_COMM_BUILD_DIR; prints the table.
EOF
}
die() { echo "bench.sh: $*" >&2; echo "Run 'scripts/bench.sh --help' for usage." >&2; exit 2; }

n="" args=()
while [ "$#" -gt 0 ]; do
  opt=$1 val=""
  case "$opt" in
    -h|--help) usage; exit 0 ;;
    --only=*|--iters=*|--out=*) val=${opt#*=}; opt=${opt%%=*} ;;
    --only|--iters|--out) [ "$#" -ge 2 ] || die "$opt needs a value"; val=$2; shift ;;
    -*) die "unknown option '$opt'" ;;
    *)
      [[ "$opt" =~ ^[1-9][0-9]*$ ]] || die "NGPUS must be a positive integer, got '$opt'"
      [ -z "$n" ] || die "NGPUS given twice ('$n' and '$opt')"
      n=$opt; shift; continue ;;
  esac
  case "$opt" in
    --only) [[ "$val" =~ ^(ag|rs)$ ]] || die "--only takes ag or rs, got '$val'" ;;
    --iters) [[ "$val" =~ ^[1-9][0-9]*$ ]] || die "--iters takes a positive integer, got '$val'" ;;
    --out) [ -n "$val" ] || die "--out needs a file name" ;;
  esac
  args+=("$opt" "$val")
  shift
done

need_gpu_machine() {
  echo "bench.sh: $*" >&2
  echo "bench.sh: the benchmark needs a GPU machine with the CUDA runtime, NCCL and MPI (and CMake);" \
       "scripts/test.sh is the check for machines without a GPU." >&2
  exit 1
}
if [ -z "$n" ]; then
  n=$(gpu_count)
  [ "$n" -ge 1 ] || need_gpu_machine "no GPU found (nvidia-smi is missing or lists none)"
fi
command -v mpirun >/dev/null || need_gpu_machine "no mpirun on PATH (MPI is missing)"

lib=$(te_comm_library)
build=${TE_COMM_BUILD_DIR:-$root/build-gpu}
mkdir -p "$build"
cmake_args=(-DTE_COMM_GPU_TESTS=ON)
[ -n "${TE_COMM_CUDA_ROOT:-}" ] && cmake_args+=(-DTE_COMM_CUDA_ROOT="$TE_COMM_CUDA_ROOT")
[ -n "${TE_COMM_NCCL_ROOT:-}" ] && cmake_args+=(-DTE_COMM_NCCL_ROOT="$TE_COMM_NCCL_ROOT")
if ! err=$(te_comm_cmake_build "$lib" "$build" "${cmake_args[@]}" 2>&1); then
  # CMake's own advice (TE_COMM_GPU_TESTS=AUTO/OFF) is for the tests, not for the benchmark.
  # (CMake wraps the message over several lines: join them first.)
  missing=$(tr -s '\n ' '  ' <"$build/configure.log" 2>/dev/null \
    | sed -n 's/.*benchmarks lack: \(.*\)\. *Configure with -DTE_COMM_GPU_TESTS.*/\1/p' || true)
  [ -z "$missing" ] || need_gpu_machine "cannot build tests_c/bench_overlap, not found: $missing (log: $build/configure.log)"
  echo "$err" >&2
  exit 1
fi
rc=0
"$root/tests_c/run_mpi.sh" "$n" "$build/tests_c/bench_overlap" "${args[@]}" || rc=$?
# run_mpi.sh exits 77 (a test skip) when fewer than NGPUS GPUs are usable; not a skip here.
[ "$rc" -ne 77 ] || need_gpu_machine "fewer than $n usable GPU(s) (see the SKIPPED line above)"
exit "$rc"
