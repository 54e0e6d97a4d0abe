// Host pieces for driving kernels/gemm_sm90.cu from plain C++ (cudart, NVRTC, cuBLASLt,
// driver entry points; no nvcc): status checks, the driver entry points, the NVRTC
// compile with the library's options, the kernel module (its 8 kernels and their shared
// memory sizes), the tensor maps, the Gemm90Args mirror, a launcher, a bounded stream
// wait, the tile-width choice, and a cuBLASLt TN plan. Used by bench/own_gemm_link.cpp;
// bench/own_gemm.cpp has its own copies of these and can adopt this header later.
// One translation unit includes it (inline functions and variables, namespace g90;
// the macros CK / NV / LT / CU are global).
#pragma once

#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <nvrtc.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace g90 {

// ---------------------------------------------------------------- error handling
// A setup error ends the process with status 2 (a wrong result is the caller's 1).
inline const char *g_prog = "gemm90";
[[noreturn]] inline void die(const char *what, const char *file, int line) {
  std::fflush(stdout);
  std::fprintf(stderr, "%s: setup error at %s:%d: %s\n", g_prog, file, line, what);
  std::exit(2);
}

}  // namespace g90

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) g90::die(cudaGetErrorString(e_), __FILE__, __LINE__);     \
  } while (0)
#define NV(x)                                                                        \
  do {                                                                               \
    nvrtcResult e_ = (x);                                                            \
    if (e_ != NVRTC_SUCCESS) g90::die(nvrtcGetErrorString(e_), __FILE__, __LINE__);  \
  } while (0)
#define LT(x)                                                                        \
  do {                                                                               \
    cublasStatus_t e_ = (x);                                                         \
    if (e_ != CUBLAS_STATUS_SUCCESS) {                                               \
      char b_[64];                                                                   \
      std::snprintf(b_, sizeof b_, "cuBLASLt status %d", (int)e_);                   \
      g90::die(b_, __FILE__, __LINE__);                                              \
    }                                                                                \
  } while (0)
#define CU(x) g90::cu_check((x), __FILE__, __LINE__)

namespace g90 {

// ---------------------------------------------------------------- driver entry points
// Through cudaGetDriverEntryPointByVersion (no -lcuda needed), the CUDA 12.0 ABI of each.
struct Driver {
  CUresult (*GetErrorString)(CUresult, const char **) = nullptr;
  CUresult (*ModuleLoadData)(CUmodule *, const void *) = nullptr;
  CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *) = nullptr;
  CUresult (*ModuleGetGlobal)(CUdeviceptr *, size_t *, CUmodule, const char *) = nullptr;
  CUresult (*FuncSetAttribute)(CUfunction, CUfunction_attribute, int) = nullptr;
  CUresult (*FuncGetAttribute)(int *, CUfunction_attribute, CUfunction) = nullptr;
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           CUstream, void **, void **) = nullptr;
  CUresult (*TensorMapEncodeTiled)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                   const cuuint64_t *, const cuuint32_t *, const cuuint32_t *,
                                   CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                   CUtensorMapFloatOOBfill) = nullptr;
  CUresult (*StreamWaitValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned) = nullptr;
  CUresult (*StreamWriteValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned) = nullptr;
};
inline Driver drv;

inline void cu_check(CUresult r, const char *file, int line) {
  if (r == CUDA_SUCCESS) return;
  const char *s = "unknown driver error";
  if (drv.GetErrorString) drv.GetErrorString(r, &s);
  char b[256];
  std::snprintf(b, sizeof b, "driver error %d: %s", (int)r, s);
  die(b, file, line);
}

template <class F>
inline void entry(const char *name, F &fn) {
  void *p = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q));
  if (p == nullptr || q != cudaDriverEntryPointSuccess) die(name, __FILE__, __LINE__);
  fn = reinterpret_cast<F>(p);
}
inline void load_driver() {
  entry("cuGetErrorString", drv.GetErrorString);
  entry("cuModuleLoadData", drv.ModuleLoadData);
  entry("cuModuleGetFunction", drv.ModuleGetFunction);
  entry("cuModuleGetGlobal", drv.ModuleGetGlobal);
  entry("cuFuncSetAttribute", drv.FuncSetAttribute);
  entry("cuFuncGetAttribute", drv.FuncGetAttribute);
  entry("cuLaunchKernel", drv.LaunchKernel);
  entry("cuTensorMapEncodeTiled", drv.TensorMapEncodeTiled);
  entry("cuStreamWaitValue32", drv.StreamWaitValue32);
  entry("cuStreamWriteValue32", drv.StreamWriteValue32);
}

// cuLaunchKernel with the kernel's parameters given as pointers to their values.
inline void launch(CUfunction f, unsigned gx, unsigned gy, unsigned bx, unsigned by, unsigned smem,
                   cudaStream_t s, std::vector<void *> args) {
  CU(drv.LaunchKernel(f, gx, gy, 1, bx, by, 1, smem, (CUstream)s, args.data(), nullptr));
}
// Stream memory operations on 32-bit words in device memory.
inline void wait_geq(cudaStream_t s, const uint32_t *p, uint32_t v) {
  CU(drv.StreamWaitValue32((CUstream)s, (CUdeviceptr)p, v, CU_STREAM_WAIT_VALUE_GEQ));
}
// Default flags: a memory fence before the write (the work before it is visible first);
// CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER: none.
// Where the driver refuses the barrier-free write (invalid argument: H100, driver
// 580.159.04, CUDA 13.0, 2026-11-26), the default one is used from then on.
inline bool g_write_no_barrier = true;
inline void write_value(cudaStream_t s, uint32_t *p, uint32_t v, unsigned flags = CU_STREAM_WRITE_VALUE_DEFAULT) {
  if (flags & CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER) {
    if (g_write_no_barrier) {
      const CUresult r = drv.StreamWriteValue32((CUstream)s, (CUdeviceptr)p, v, flags);
      if (r == CUDA_SUCCESS) return;
      if (r != CUDA_ERROR_INVALID_VALUE) CU(r);
      g_write_no_barrier = false;
      std::printf("note: cuStreamWriteValue32 refuses CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER here; "
                  "every write keeps its memory barrier\n");
    }
    flags &= ~(unsigned)CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER;
  }
  CU(drv.StreamWriteValue32((CUstream)s, (CUdeviceptr)p, v, flags));
}

// ---------------------------------------------------------------- NVRTC
// The library's options (src/cuda/nvrtc.rs `options`) for `arch`, plus `extra` (-D knobs,
// --maxrregcount, ...). Returns the cubin; the log is printed on failure or when verbose.
inline std::vector<char> nvrtc_compile(const std::string &src, const char *name, const std::string &arch,
                                       const std::vector<std::string> &extra, bool verbose) {
  nvrtcProgram prog;
  NV(nvrtcCreateProgram(&prog, src.c_str(), name, 0, nullptr, nullptr));
  const std::string a = "--gpu-architecture=" + arch;
  std::vector<const char *> opts = {a.c_str(), "--std=c++17", "--device-as-default-execution-space", "-lineinfo"};
  for (auto &e : extra) opts.push_back(e.c_str());
  if (verbose) opts.push_back("--ptxas-options=-v");
  const nvrtcResult r = nvrtcCompileProgram(prog, (int)opts.size(), opts.data());
  size_t n = 0;
  nvrtcGetProgramLogSize(prog, &n);
  std::string log(n, '\0');
  if (n) nvrtcGetProgramLog(prog, &log[0]);
  if (r != NVRTC_SUCCESS || verbose) std::printf("NVRTC log for %s (%s):\n%s\n", name, arch.c_str(), log.c_str());
  if (r != NVRTC_SUCCESS) die("NVRTC compilation failed", __FILE__, __LINE__);
  size_t cn = 0;
  NV(nvrtcGetCUBINSize(prog, &cn));
  std::vector<char> cubin(cn);
  NV(nvrtcGetCUBIN(prog, cubin.data()));
  nvrtcDestroyProgram(&prog);
  return cubin;
}

inline std::string read_text(const std::string &p) {
  std::ifstream f(p);
  if (!f) die(("cannot read " + p).c_str(), __FILE__, __LINE__);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// ---------------------------------------------------------------- the kernel's arguments
// Gemm90Args of kernels/gemm_sm90.cu, field for field (8-byte pointers, then 4-byte
// fields, no padding).
struct Gemm90Args {
  void *d;
  const void *bias;
  void *aux;
  const float *a_scale_inv, *b_scale_inv, *d_scale;
  float *d_amax;
  const uint32_t *flags;
  uint32_t *done;
  int m, n, k, rows_per_flag, done_rows, group_n, n_tile_rot;
  uint32_t flag_value, done_value;
  float beta;
  int epilogue, k_pieces;
  const void *copy_src;  // the side copy (0 bytes: none)
  void *copy_dst;
  unsigned long long copy_bytes;
  uint32_t *stall;  // where an arrival wait that gave up records it (null: waits never give up)
  unsigned long long stall_ns;
};
static_assert(sizeof(Gemm90Args) == 160, "Gemm90Args mirrors the kernel's struct");

constexpr int THREADS = 384;  // gemm90::THREADS
constexpr int BM = 128;       // gemm90::BM: rows of D per tile

// The compiled kernel module: gemm_sm90_tn_<in>_<in>_<out>_<BN> and their shared memory sizes
// (gemm_sm90_smem_bytes_<BN>, read from the module), max dynamic shared memory set.
// Tile widths: index 0 = 128, 1 = 256, 2 = 192 (the ping-pong kernels: bf16 out only).
inline int bn_idx(int bn) { return bn == 256 ? 1 : bn == 192 ? 2 : 0; }
inline int bn_of(int w) { return w == 1 ? 256 : w == 2 ? 192 : 128; }
struct Module {
  CUmodule mod = nullptr;
  CUfunction fn[2][2][3] = {};  // [fp8][out_f32][bn_idx] (null: not in the module)
  int smem[3] = {0, 0, 0};      // [bn_idx]
  int regs[2][2][3] = {};       // registers per thread, as compiled
  bool has_pp = false;          // the BN-192 kernels are there (a kernel file older than them: not)
  void load(const std::vector<char> &cubin) {
    CU(drv.ModuleLoadData(&mod, cubin.data()));
    for (int w = 0; w < 3; ++w) {
      char g[64];
      std::snprintf(g, sizeof g, "gemm_sm90_smem_bytes_%d", bn_of(w));
      CUdeviceptr dp;
      size_t bytes = 0;
      if (w == 2) {
        has_pp = drv.ModuleGetGlobal(&dp, &bytes, mod, g) == CUDA_SUCCESS;
        if (!has_pp) continue;
      } else {
        CU(drv.ModuleGetGlobal(&dp, &bytes, mod, g));
      }
      if (bytes != sizeof(int)) die(g, __FILE__, __LINE__);
      CK(cudaMemcpy(&smem[w], (const void *)dp, sizeof(int), cudaMemcpyDeviceToHost));
    }
    const char *in_names[2] = {"bf16", "e4m3"}, *out_names[2] = {"bf16", "f32"};
    for (int f8 = 0; f8 < 2; ++f8)
      for (int o = 0; o < 2; ++o)
        for (int w = 0; w < 3; ++w) {
          char name[64];
          std::snprintf(name, sizeof name, "gemm_sm90_tn_%s_%s_%s_%d", in_names[f8], in_names[f8], out_names[o],
                        bn_of(w));
          if (w == 2 && (o == 1 || !has_pp)) continue;  // BN 192: bf16 out only
          CU(drv.ModuleGetFunction(&fn[f8][o][w], mod, name));
          CU(drv.FuncSetAttribute(fn[f8][o][w], CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem[w]));
          CU(drv.FuncGetAttribute(&regs[f8][o][w], CU_FUNC_ATTRIBUTE_NUM_REGS, fn[f8][o][w]));
        }
  }
};
inline Module gemm_mod;
inline int g_sms = 132;

// ---------------------------------------------------------------- tensor maps
// A row-major [rows, k] operand, K contiguous, box {128 bytes of K, box_rows}, 128B
// swizzle. False (the driver's reason printed) when the driver refuses it.
inline bool tmap(CUtensorMap &t, void *ptr, bool fp8, int rows, int k, int box_rows) {
  const int es = fp8 ? 1 : 2;
  cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)rows};
  cuuint64_t strides[1] = {(cuuint64_t)k * es};
  cuuint32_t box[2] = {(cuuint32_t)(128 / es), (cuuint32_t)box_rows};
  cuuint32_t estr[2] = {1, 1};
  const CUresult r = drv.TensorMapEncodeTiled(
      &t, fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, dims, strides, box, estr,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    const char *e = "unknown";
    drv.GetErrorString(r, &e);
    std::printf("  cuTensorMapEncodeTiled refused rows %d k %d box %d x %d: %s\n", rows, k, 128 / es, box_rows, e);
  }
  return r == CUDA_SUCCESS;
}

// The kernel's constraints (kernels/gemm_sm90.cu header): k > 0, k * sizeof(in) % 16 == 0,
// m % 8 == 0, n >= 1; pointers 16-byte aligned.
inline bool shape_ok(bool fp8, int m, int n, int k) {
  return k > 0 && (k * (fp8 ? 1 : 2)) % 16 == 0 && m > 0 && m % 8 == 0 && n >= 1;
}

// Tile width: 256 unless 128 fills the last wave clearly better (as bench/own_gemm.cpp).
inline int pick_bn(int m, int n, int sms) {
  auto eff = [&](int bn) {
    const long t = (long)((n + BM - 1) / BM) * ((m + bn - 1) / bn);
    const long waves = (t + sms - 1) / sms;
    const double useful = (double)m * n / ((double)t * BM * bn);
    return useful * t / (double)(waves * sms);
  };
  return eff(128) > eff(256) + 0.05 ? 128 : 256;
}

// Pieces per destination block of the fused reduce-scatter (src/gemm/sm90.rs rs_pieces:
// keep the two in step; the library takes bn = pick_bn(m, n, sms), the fused kernel's
// width): at least as many as make one piece's tiles (bn wide) fit in one round of `sms`
// CTAs (whole tile rows dividing the block; every tile row its own piece where none
// fits); `want` where that is more, where want is 1, or where the block is not whole tile rows.
inline int rs_pieces(int want, int rows, int m, int bn, int sms) {
  if (want <= 1 || rows <= 0 || rows % BM) return want;
  const int tile_rows = rows / BM, per_row = (m + bn - 1) / bn;
  int fits = tile_rows;
  for (int p = 1; p <= tile_rows; ++p)
    if (tile_rows % p == 0 && (long)(tile_rows / p) * per_row <= std::max(sms, 1)) {
      fits = p;
      break;
    }
  return std::max(fits, want);
}

// Whether the ping-pong width (BN 192: bf16 D; src/gemm/sm90.rs takes it for GEMMs without
// flags or done signals) beats the cooperative width bn: src/gemm/sm90.rs pingpong_pays
// (the same model and margin: keep the two in step). A round of
// cooperative tiles of width bn costs its k plus the epilogue, a ping-pong round the longer
// of 3/4 k (tensor cores) and 3/8 k + 3/4 epilogue (two warpgroups in turn, each storing
// 1.5 times a cooperative warpgroup's share), plus the last epilogue.
inline bool pingpong_pays(int m, int n, int k, bool fp8, int bn, int sms) {
  const double epi = fp8 ? 320.0 : 160.0;
  const long rows = (n + BM - 1) / BM;
  auto rounds = [&](int w) { return (double)((rows * ((m + w - 1) / w) + sms - 1) / sms); };
  if (rounds(192) < 2.0) return false;  // one round: a consumer warpgroup idle in most CTAs
  const double coop = rounds(bn) * (k + epi) * bn / 256.0;
  const double pp = rounds(192) * std::max(0.75 * k, 0.375 * k + 0.75 * epi) + 0.75 * epi;
  return pp <= 0.93 * coop;
}

// Tile width of a GEMM waiting on arrival flags of row pieces (src/gemm/sm90.rs
// pick_bn_waiting): 128 where 256-wide tiles fill at most 4 waves (the tail after the last
// arrival is about one tile's time), else pick_bn. (Arrivals in K slices: pick_bn.)
inline int pick_bn_waiting(int m, int n, int sms) {
  const int bn = pick_bn(m, n, sms);
  const long tiles = (long)((n + BM - 1) / BM) * ((m + 255) / 256);
  return bn == 256 && tiles <= 4L * sms ? 128 : bn;
}

// ---------------------------------------------------------------- our GEMM
// D[n, m] = B[n, k] . A[m, k]^T (times *a_si * *b_si for e4m3). Fill the fields, call
// prepare() once (tensor maps), then run(stream) any number of times; flag_value /
// done_value may change between runs.
struct Own {
  bool fp8 = false, out_f32 = false;
  int m = 0, n = 0, k = 0, bn = 256, group_n = 8, rot = 0;
  int grid = 0;  // CTAs; 0: min(tiles, SMs)
  const uint32_t *flags = nullptr;
  int rows_per_flag = 0;
  int k_pieces = 0;  // > 1: a flag per K slice of each row block (kernels/gemm_sm90.cu k_pieces)
  uint32_t flag_value = 1;
  uint32_t *done = nullptr;  // 2 * ceil(n / done_rows) words, the second half zero at launch
  int done_rows = 0;
  uint32_t done_value = 1;
  void *A = nullptr, *B = nullptr, *D = nullptr;
  const float *a_si = nullptr, *b_si = nullptr;
  CUtensorMap ta, tb;
  bool prepare() { return shape_ok(fp8, m, n, k) && tmap(tb, B, fp8, n, k, BM) && tmap(ta, A, fp8, m, k, bn); }
  int tiles() const { return ((n + BM - 1) / BM) * ((m + bn - 1) / bn); }
  int grid_used() const { return std::min(tiles(), grid > 0 ? grid : g_sms); }
  CUfunction fn() const { return gemm_mod.fn[fp8][out_f32][bn_idx(bn)]; }
  void run(cudaStream_t s) {
    Gemm90Args g;
    std::memset(&g, 0, sizeof g);
    g.d = D;
    g.a_scale_inv = a_si;
    g.b_scale_inv = b_si;
    g.flags = flags;
    g.done = done;
    g.m = m;
    g.n = n;
    g.k = k;
    g.rows_per_flag = flags ? rows_per_flag : 0;
    g.k_pieces = flags ? k_pieces : 0;
    g.done_rows = done ? done_rows : 0;
    g.group_n = group_n;
    g.n_tile_rot = rot;
    g.flag_value = flag_value;
    g.done_value = done_value;
    launch(fn(), (unsigned)grid_used(), 1, THREADS, 1, (unsigned)gemm_mod.smem[bn_idx(bn)], s, {&tb, &ta, &g});
  }
};

// ---------------------------------------------------------------- bounded waits
// Called (if set) when a bounded wait gives up, before the process ends: a program's
// diagnosis and whatever results it has (it must not wait on the device itself).
inline void (*g_on_hang)(const char *what) = nullptr;

// Waits for stream s; still busy after `seconds`: prints HANG, calls g_on_hang and ends
// the process with status 1 (the driver tears the context down, so nothing keeps the GPU).
inline void wait_stream(cudaStream_t s, const char *what, int seconds = 60) {
  const auto t0 = std::chrono::steady_clock::now();
  cudaError_t q;
  while ((q = cudaStreamQuery(s)) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(seconds)) {
      std::printf("HANG: %s still running after %d s\n", what, seconds);
      std::fflush(stdout);
      if (g_on_hang) {
        void (*h)(const char *) = g_on_hang;
        g_on_hang = nullptr;  // once
        h(what);
      }
      std::fflush(stdout);
      std::_Exit(1);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  CK(q);
  CK(cudaGetLastError());
}

// ---------------------------------------------------------------- cuBLASLt
// nvte_cublas_gemm's TN in column-major terms: D(m x n, ld m) = A(k x m)^T . B(k x n);
// the same D[n, m] = B[n, k] . A[m, k]^T as ours. One plan per shape.
struct LtPlan {
  cublasLtHandle_t h = nullptr;
  void *ws = nullptr;
  size_t wsz = 0;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulHeuristicResult_t heurs[8];
  int nheur = 0, pick = 0, sm_target = 0;
  cublasStatus_t last = CUBLAS_STATUS_SUCCESS;
  void release() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    op = nullptr;
    la = lb = ld = nullptr;
  }
  // sm_target > 0: CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET (plan for that many SMs, other
  // work holding the rest). False when the heuristic offers nothing.
  bool setup(cublasLtHandle_t handle, void *workspace, size_t ws_bytes, bool fp8, bool out_f32, int m, int n, int k,
             const float *a_si, const float *b_si, int sm_count_target = 0) {
    release();
    h = handle;
    ws = workspace;
    wsz = ws_bytes;
    sm_target = sm_count_target;
    LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (fp8) {
      LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_si, sizeof a_si));
      LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_si, sizeof b_si));
      int8_t fast = 1;  // our kernel has wgmma's fast accumulation only
      LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    }
    if (sm_count_target > 0) {
      int32_t t = sm_count_target;
      LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &t, sizeof t));
    }
    const cudaDataType_t tin = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF, tout = out_f32 ? CUDA_R_32F : CUDA_R_16BF;
    LT(cublasLtMatrixLayoutCreate(&la, tin, k, m, k));
    LT(cublasLtMatrixLayoutCreate(&lb, tin, k, n, k));
    LT(cublasLtMatrixLayoutCreate(&ld, tout, m, n, m));
    cublasLtMatmulPreference_t pref;
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof wsz));
    nheur = 0;
    pick = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 8, heurs, &nheur);
    cublasLtMatmulPreferenceDestroy(pref);
    return st == CUBLAS_STATUS_SUCCESS && nheur > 0;
  }
  cublasStatus_t try_run(const void *A, const void *B, void *D, cudaStream_t s) {
    const float alpha = 1.f, beta = 0.f;
    return cublasLtMatmul(h, op, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &heurs[pick].algo, ws, wsz, s);
  }
  // The first heuristic candidate that runs (cuBLASLt 13.1 answered NOT_SUPPORTED for
  // some top e4m3 candidates on an H100, 2026-11-26); false if none.
  bool first_run(const void *A, const void *B, void *D, cudaStream_t s) {
    for (pick = 0; pick < nheur; ++pick) {
      last = try_run(A, B, D, s);
      if (last == CUBLAS_STATUS_SUCCESS) return true;
    }
    pick = 0;
    return false;
  }
  void run(const void *A, const void *B, void *D, cudaStream_t s) { LT(try_run(A, B, D, s)); }
};

}  // namespace g90
