// The header and cuda_runtime.h together, in either order (CUDA_FIRST picks).
#ifdef CUDA_FIRST
#include <cuda_runtime.h>
#include "transformer_engine_comm.h"
#else
#include "transformer_engine_comm.h"
#include <cuda_runtime.h>
#endif
void te_comm_header_with_cuda_check(cudaStream_t s, NVTETensor t) { nvte_quantize(t, t, s); }
