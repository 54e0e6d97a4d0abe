// The public header compiles alone as C++17 (with -pedantic-errors), C linkage included.
#include "transformer_engine_comm.h"
static_assert(sizeof(NVTEShape) == 16 * sizeof(size_t), "NVTEShape layout");
static_assert(kNVTEFloat8E4M3 == 7, "TE enum value");
int te_comm_header_cxx17_check() { return nvte_comm_last_error() != nullptr; }
