// NCCL helpers shared by the GPU tests and benchmarks that use NCCL directly (the
// references and setup); the rest of the shared helpers are in test_util.hpp.
#pragma once
#include <mpi.h>
#include <nccl.h>

#include <cstdio>

#define NCCL_OK(x)                                                                          \
  do {                                                                                      \
    ncclResult_t r_ = (x);                                                                  \
    if (r_ != ncclSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, ncclGetErrorString(r_)); \
      MPI_Abort(MPI_COMM_WORLD, 3);                                                         \
    }                                                                                       \
  } while (0)
