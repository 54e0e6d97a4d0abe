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
for v in NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS LD_LIBRARY_PATH \
         NVTE_COMM_DEBUG NVTE_COMM_CACHE_DIR NVTE_COMM_TIMEOUT_MS; do
  [ -n "${!v+x}" ] && extra+=(-x "$v")
done
exec mpirun "${extra[@]}" --oversubscribe --bind-to none -np "$np" "$exe" "$@"
