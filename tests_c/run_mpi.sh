#!/usr/bin/env bash
# run_mpi.sh NP EXE [ARGS...]: run a GPU test on NP ranks (one GPU each).
# Exits 77 (CTest "skipped") when fewer than NP GPUs are usable, without starting MPI.
set -u
np=$1; shift
exe=$1; shift
"$exe" --probe "$np" || exit $?
# Never NVLink multicast (NVLS): it can take shared GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-run-as-root)
# Forward the multicast switches, the library path and every NVTE_* / NCCL_* setting.
for v in TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS LD_LIBRARY_PATH CUDA_DEVICE_MAX_CONNECTIONS \
         $(compgen -e | grep -E '^(NVTE_|NCCL_)'); do
  [ -n "${!v+x}" ] && extra+=(-x "$v")
done
# TE_COMM_SANITIZER=memcheck|racecheck|synccheck|initcheck: every rank under compute-sanitizer
# (host backtraces on, so each report can be attributed to the library it came from).
wrap=()
if [ -n "${TE_COMM_SANITIZER:-}" ]; then
  wrap=(compute-sanitizer --tool "$TE_COMM_SANITIZER" --error-exitcode 9 --print-limit 1000 --show-backtrace host)
fi
exec mpirun "${extra[@]}" --oversubscribe --bind-to none -np "$np" "${wrap[@]}" "$exe" "$@"
